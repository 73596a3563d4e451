"""Paged attention in Triton: decode (one query token per sequence) and ragged prefill / mixed
batches, both over the paged KV cache, both equal to ``deltaserve.model.attention.paged_attention_ref``.

Semantics: exactly ``paged_attention_ref``'s (its module docstring is the one definition), restated
with the metadata these kernels read instead of ``positions``::

    for b in range(B):                                  # sequence b of the step
        rows  = [query_start_loc[b], query_start_loc[b+1]);  q_len = len(rows)
        ctx   = seq_lens[b]                             # cached prefix + this step's tokens
        K_b[j] = cache_k[block_tables[b, j // bs], j % bs]        for j in [0, ctx)
        for i, t in enumerate(rows):
            p = ctx - q_len + i                         # = positions[t] (ForwardBatch.build)
            visible = { j : j <= p and (window is None or j > p - window) }
            for h in range(H):
                s_j = scale * q[t, h] . K_b[j, h // (H / H_kv)]
                s_j = softcap * tanh(s_j / softcap)             # only when softcap is given (Gemma 2)
                out[t, h] = softmax_j(s_j) @ V_b[j, ...]   over visible j
    (a sequence with ctx == 0, e.g. a CUDA-graph padding row, gets out = 0)

Shape:
    q:               [T, H, D]        float32 / float16 / bfloat16, last dim contiguous
    cache_k/cache_v: [num_blocks, block_size, H_kv, D]   same dtype as q, last dim contiguous
    block_tables:    [B, max_blocks]  int32, page ids in position order (entries past ctx unused)
    seq_lens:        [B]              int32, ctx per sequence
    query_start_loc: [B + 1]          int32, cumulative query rows
    max_query_len:   Python int, max q_len (1 selects the decode kernel)
    out:             [T, H, D]        dtype of q

How: each program owns one kv head of one sequence (decode: its single token; prefill: a tile
of BLOCK_Q query tokens) together with all H / H_kv query heads of that group, stacked as the rows
of one [BLOCK_Q * BLOCK_G, D] tile, so each K/V page is read once per group. It walks the
sequence's keys in tiles of BLOCK_N positions, looking each position's page up in the block table
(so pages may sit anywhere in the pool, in any order, and BLOCK_N need not equal block_size),
and keeps an online softmax in float32 (flash attention). Decode optionally splits the context
over NUM_SPLITS programs (flash-decoding) and merges the partial results in a second kernel.
Prefill does the same for small steps (``prefill_num_splits``): a prefix-cache hit's few query
tokens over a long cached context are one query tile per head group, too few programs to read the
context at the device's bandwidth, so each tile's keys are split over up to NUM_SPLITS programs
(at least ``PREFILL_SPLIT_MIN_TILES`` key tiles each: a short context keeps one) and a merge
kernel combines them.

Decode is CUDA-graph capturable: no host synchronisation, and the grid depends only on
(num_seqs, num_kv_heads, num_splits); lengths and block tables are read on the device. Prefill is
too when given ``tiles`` ([N, 2] int32, ``prefill_tiles``: the (sequence, query tile) rows, real
ones first, then idle rows of sequence -1) and ``tile_count`` (how many are real, on the device):
the grid follows the step's token bound (q's rows) and each program loops over the real tiles' work
items, so a graph's grid is fixed whatever the step's lengths (``worker/mixed_graphs.py`` sizes N
for its token and sequence bounds) and idle rows cost no program.

Under ``TRITON_INTERPRET=1`` (CPU tensors) the tiles are upcast to float32 before ``tl.dot`` (the
interpreter's bf16 dot is wrong); on CUDA fp16/bf16 tiles go to the tensor cores as they are and
accumulate in float32, with the probabilities cast to the value dtype as flash attention does.
"""

from __future__ import annotations

import functools
import os

import torch
import triton

from .paged_attention_kernels import (
    paged_decode_kernel,
    paged_decode_reduce_kernel,
    paged_prefill_kernel,
    paged_prefill_merge_kernel,
)

_LOG2E = 1.4426950408889634  # the kernels work in base 2: qk_scale = scale * log2(e), exp2


# ---------------------------------------------------------------------------------------------
# Host side: validation, launch configuration, dispatch.

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _interpreting(device: torch.device) -> bool:
    if device.type == "cuda":
        return False
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"paged_attention (Triton) got {device.type} tensors: it needs CUDA tensors, or "
            "TRITON_INTERPRET=1 set before triton is imported (CPU tests)"
        )
    return True


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def decode_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """How many programs share one (sequence, kv head)'s context in decode (a power of two, 1..16).

    Enough programs to fill the device twice over, but at least 128 keys per split. ``max_seq_len``
    is an upper bound on the context: a CUDA-graph runner passes the static maximum it captures for
    (the result is then fixed per graph; any split count gives the same attention).
    """
    if num_seqs < 1 or num_kv_heads < 1:
        return 1
    want = min(-(-2 * num_sms // (num_seqs * num_kv_heads)), -(-max_seq_len // 128), 16)
    splits = 1
    while splits * 2 <= want:
        splits *= 2
    return splits


def _check(q, cache_k, cache_v, block_tables, seq_lens, query_start_loc):
    if q.dim() != 3 or cache_k.dim() != 4 or cache_v.shape != cache_k.shape:
        raise ValueError(
            f"paged_attention: want q [T, H, D] and cache_k == cache_v [num_blocks, block_size, H_kv, D], "
            f"got q {tuple(q.shape)}, cache_k {tuple(cache_k.shape)}, cache_v {tuple(cache_v.shape)}"
        )
    num_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = cache_k.shape[2]
    if cache_k.shape[3] != head_dim:
        raise ValueError(f"paged_attention: q head_dim {head_dim} != cache head_dim {cache_k.shape[3]}")
    if num_heads % kv_heads != 0:
        raise ValueError(f"query heads {num_heads} not a multiple of kv heads {kv_heads}")
    if q.dtype not in _DTYPES or cache_k.dtype != q.dtype or cache_v.dtype != q.dtype:
        raise ValueError(
            f"paged_attention: q and the cache must share one of {_DTYPES}, got q {q.dtype}, "
            f"cache {cache_k.dtype}/{cache_v.dtype}"
        )
    if q.stride(-1) != 1 or cache_k.stride(-1) != 1 or cache_v.stride(-1) != 1:
        raise ValueError("paged_attention: the head dimension of q and of the cache must be contiguous")
    for name, t, dims in (
        ("block_tables", block_tables, 2),
        ("seq_lens", seq_lens, 1),
        ("query_start_loc", query_start_loc, 1),
    ):
        if t.dtype != torch.int32 or t.dim() != dims or t.device != q.device:
            raise ValueError(
                f"paged_attention: {name} must be a {dims}-d int32 tensor on {q.device}, "
                f"got {t.dtype} {tuple(t.shape)} on {t.device}"
            )
    num_seqs = seq_lens.shape[0]
    if block_tables.shape[0] != num_seqs or query_start_loc.shape[0] != num_seqs + 1:
        raise ValueError(
            f"paged_attention: {num_seqs} sequences but block_tables has {block_tables.shape[0]} rows "
            f"and query_start_loc {query_start_loc.shape[0]} entries (want B and B + 1)"
        )
    if block_tables.stride(1) != 1 or seq_lens.stride(0) != 1 or query_start_loc.stride(0) != 1:
        raise ValueError("paged_attention: metadata tensors must be contiguous")


def _common(q, cache_k, scale, sliding_window, softcap=None):
    interp = _interpreting(q.device)
    head_dim = q.shape[2]
    group = q.shape[1] // cache_k.shape[2]
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"paged_attention: sliding_window must be >= 1 or None, got {sliding_window}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"paged_attention: softcap must be positive or None, got {softcap}")
    # Soft-cap: s = cap * tanh(scale * q.k / cap) in log2 units = (cap * log2 e) * tanh((scale / cap) * q.k).
    return dict(
        qk_scale=float(scale) * _LOG2E if softcap is None else float(scale) / float(softcap),
        cap_log2=0.0 if softcap is None else float(softcap) * _LOG2E,
        HAS_SOFTCAP=softcap is not None,
        window=int(sliding_window or 0),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=cache_k.shape[1],
        HAS_WINDOW=sliding_window is not None,
        UPCAST=interp,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    ), interp


def _block_n(block_n: int | None, interp: bool) -> int:
    """Keys per tile: 64 on GPUs (at least 16, tl.dot's minimum), 16 by default when interpreted."""
    if block_n is None:
        return 16 if interp else 64
    if block_n < 1 or block_n & (block_n - 1):
        raise ValueError(f"paged_attention: block_n must be a power of two, got {block_n}")
    return block_n if interp else max(block_n, 16)


def _strides(q, out, cache_k, cache_v, block_tables):
    return dict(
        stride_qt=q.stride(0),
        stride_qh=q.stride(1),
        stride_ot=out.stride(0),
        stride_oh=out.stride(1),
        stride_kb=cache_k.stride(0),
        stride_kt=cache_k.stride(1),
        stride_kh=cache_k.stride(2),
        stride_vb=cache_v.stride(0),
        stride_vt=cache_v.stride(1),
        stride_vh=cache_v.stride(2),
        stride_bt=block_tables.stride(0),
        max_blocks=block_tables.shape[1],
    )


def paged_decode(
    q: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
    block_n: int | None = None,
    out: torch.Tensor | None = None,
    softcap: float | None = None,
    query_start_loc: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode: one query token per sequence (row b of ``q`` belongs to sequence b); see the module.

    Semantics: the module's, with ``query_start_loc = arange(B + 1)``.
    Shape: q [B, H, D]; cache_k, cache_v [num_blocks, block_size, H_kv, D]; block_tables
    [B, max_blocks] int32; seq_lens [B] int32; out [B, H, D] (written in place when given).
    ``num_splits``: programs per (sequence, kv head); None picks ``decode_num_splits`` from
    ``max_seq_len`` (an upper bound on seq_lens; None means block_tables' capacity). No host sync.
    ``query_start_loc`` ([B + 1] int32): a mixed batch (q [T, H, D]): only the sequences of one token
    are computed, each at its row, one split each (a fixed program, whatever the batch: a CUDA graph's
    replay and the eager step agree bit for bit); rows of other sequences are left as they are.
    """
    num_seqs = seq_lens.shape[0]
    ragged = query_start_loc is not None
    qsl = query_start_loc if ragged else torch.empty(num_seqs + 1, dtype=torch.int32, device=q.device)
    _check(q, cache_k, cache_v, block_tables, seq_lens, qsl)
    if ragged:
        num_splits = 1
    elif q.shape[0] != num_seqs:
        raise ValueError(f"paged_decode: q has {q.shape[0]} rows for {num_seqs} sequences (want one each)")
    consts, interp = _common(q, cache_k, scale, sliding_window, softcap)
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"paged_decode: out must be {tuple(q.shape)} {q.dtype} with a contiguous last dim")
    kv_heads = cache_k.shape[2]
    if num_splits is None:
        bound = max_seq_len if max_seq_len is not None else block_tables.shape[1] * cache_k.shape[1]
        num_splits = 1 if interp else decode_num_splits(num_seqs, kv_heads, bound, _num_sms(q.device.index or 0))
    if num_splits < 1:
        raise ValueError(f"paged_decode: num_splits must be >= 1, got {num_splits}")
    block_n = _block_n(block_n, interp)
    block_g = max(16, triton.next_power_of_2(consts["GROUP"]))  # tl.dot wants >= 16 rows on GPUs
    if num_seqs == 0:
        return out
    head_dim_pad = consts["BLOCK_D"]
    if num_splits > 1:
        part_acc = torch.empty((num_seqs, q.shape[1], num_splits, head_dim_pad), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((num_seqs, q.shape[1], num_splits, 2), dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused by the single-pass variant
    extra = {} if interp else {"num_warps": 4, "num_stages": 2}
    paged_decode_kernel[(num_seqs, kv_heads, num_splits)](
        out,
        part_acc,
        part_ml,
        q,
        cache_k,
        cache_v,
        block_tables,
        seq_lens,
        qsl,
        **_strides(q, out, cache_k, cache_v, block_tables),
        **consts,
        BLOCK_G=block_g,
        BLOCK_N=block_n,
        NUM_SPLITS=num_splits,
        RAGGED=ragged,
        **extra,
    )
    if num_splits > 1:
        paged_decode_reduce_kernel[(num_seqs, q.shape[1])](
            out,
            part_acc,
            part_ml,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=consts["HEAD_DIM"],
            BLOCK_D=head_dim_pad,
            NUM_SPLITS=num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits),
            **({} if interp else {"num_warps": 4}),
        )
    return out


PREFILL_SPLIT_TOKENS = (64, 128, 256)
"""Step sizes (tokens) up to which prefill splits keys, each a bound of ``prefill_num_splits``'s
ranges. Each is a mixed-graph token bucket (``worker/mixed_graphs.TOKEN_BUCKETS``), so a step and the
bucket it replays in get the same split count: replay and eager agree bit for bit."""
PREFILL_WARPS = 4
"""Warps per prefill program on GPUs."""
PREFILL_STAGES = 2
"""Software-pipeline stages of the prefill program's key loop on GPUs."""
PREFILL_SPLIT_MIN_TILES = 2
"""Fewest key tiles (BLOCK_N keys each) one prefill split takes."""


def prefill_num_splits(num_tokens: int, num_kv_heads: int, block_q: int, num_sms: int) -> int:
    """Key splits per query tile for a prefill launch over ``num_tokens`` query rows (a power of two,
    1..16): enough programs to fill the device twice over when every token sits in as few query tiles
    as possible, 1 above the last ``PREFILL_SPLIT_TOKENS`` bound. Constant over each range between
    those bounds, so it depends on the step's token bucket only (see there)."""
    bound = next((t for t in PREFILL_SPLIT_TOKENS if num_tokens <= t), None)
    if bound is None or num_kv_heads < 1:
        return 1
    want = min(2 * num_sms // (-(-bound // block_q) * num_kv_heads), 16)
    splits = 1
    while splits * 2 <= want:
        splits *= 2
    return splits


def _default_prefill_splits(q: torch.Tensor, num_kv_heads: int, block_q: int, interpreting: bool) -> int:
    """``paged_prefill``'s split count when the caller names none: ``prefill_num_splits`` over q's rows
    on GPUs; 1 under the interpreter (tests that want the rule there patch this function)."""
    if interpreting:
        return 1
    return prefill_num_splits(q.shape[0], num_kv_heads, block_q, _num_sms(q.device.index or 0))


def prefill_block_q(num_heads: int, num_kv_heads: int, interpreting: bool) -> int:
    """Query tokens per prefill program (``paged_prefill``'s default ``block_q``): 64 rows of
    tokens x next_pow2(H / H_kv) heads on GPUs (at least 16 rows), 16 rows when interpreted."""
    block_g = triton.next_power_of_2(num_heads // num_kv_heads)
    block_q = max(1, (16 if interpreting else 64) // block_g)
    if block_q * block_g < 16 and not interpreting:
        block_q = 16 // block_g  # tl.dot wants >= 16 rows on GPUs
    return block_q


def prefill_tiles(q_lens: list[int], block_q: int, skip_single: bool = False) -> list[int]:
    """The (sequence, query tile) rows of a tiled prefill launch, flattened ``[b, tile, b, tile, ...]``:
    ``ceil(q_len / block_q)`` per sequence, in order; at most ``sum(q_lens) / block_q + len(q_lens)``.
    ``skip_single``: none for sequences of one token (``paged_prefill``'s ``skip_single``)."""
    tiles: list[int] = []
    for b, n in enumerate(q_lens):
        if skip_single and n == 1:
            continue
        for k in range(-(-n // block_q)):
            tiles += (b, k)
    return tiles


def paged_prefill(
    q: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    sliding_window: int | None = None,
    block_q: int | None = None,
    block_n: int | None = None,
    out: torch.Tensor | None = None,
    softcap: float | None = None,
    tiles: torch.Tensor | None = None,
    skip_single: bool = False,
    num_splits: int | None = None,
    tile_count: torch.Tensor | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Ragged prefill / mixed batch (any q_len per sequence, causal over the paged context).

    Semantics: the module's. Shape: q [T, H, D]; cache_k, cache_v [num_blocks, block_size, H_kv, D];
    block_tables [B, max_blocks] int32; seq_lens [B] int32; query_start_loc [B + 1] int32;
    max_query_len >= every q_len (sizes the grid); out [T, H, D].
    ``block_q`` query tokens x next_pow2(H / H_kv) heads form one program's rows.
    ``tiles``: [N, 2] int32 on q's device, (sequence, query tile) of each program (``prefill_tiles``
    with the default ``block_q``; rows of sequence -1 are idle): every tile of every sequence must be
    listed, real rows first. ``tile_count`` ([1] int32 on q's device): how many rows are real (None:
    all N). The grid then follows q's rows, not ``max_query_len`` or the step's sequences (a CUDA
    graph's fixed grid), and its programs loop over the real tiles' work.
    ``skip_single``: sequences of one token are left out (their rows untouched: ``paged_decode``
    with ``query_start_loc`` computes them).
    ``num_splits``: most key splits per query tile (each tile uses as many as its keys fill,
    ``PREFILL_SPLIT_MIN_TILES`` key tiles each); None: ``prefill_num_splits`` of q's rows on GPUs, 1
    when interpreted. Two launches with the same value give the same bits.
    ``num_warps`` / ``num_stages``: the prefill program's launch (None: ``PREFILL_WARPS`` /
    ``PREFILL_STAGES``; ``bench.prefill_attention_sweep`` tries others).
    """
    _check(q, cache_k, cache_v, block_tables, seq_lens, query_start_loc)
    consts, interp = _common(q, cache_k, scale, sliding_window, softcap)
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"paged_prefill: out must be {tuple(q.shape)} {q.dtype} with a contiguous last dim")
    num_seqs, kv_heads = seq_lens.shape[0], cache_k.shape[2]
    if num_seqs == 0 or max_query_len < 1:
        return out
    block_g = triton.next_power_of_2(consts["GROUP"])
    if block_q is None:
        block_q = prefill_block_q(q.shape[1], kv_heads, interp)
    if block_q < 1 or block_q & (block_q - 1):
        raise ValueError(f"paged_prefill: block_q must be a power of two, got {block_q}")
    if block_q * block_g < 16 and not interp:
        block_q = 16 // block_g  # tl.dot wants >= 16 rows on GPUs
    block_n = _block_n(block_n, interp)
    if num_splits is None:
        num_splits = _default_prefill_splits(q, kv_heads, block_q, interp)
    if num_splits < 1:
        raise ValueError(f"paged_prefill: num_splits must be >= 1, got {num_splits}")
    extra = {} if interp else {"num_warps": num_warps or PREFILL_WARPS, "num_stages": num_stages or PREFILL_STAGES}
    grid = (triton.cdiv(max_query_len, block_q), num_seqs, kv_heads)
    if tiles is not None:
        if tiles.dtype != torch.int32 or tiles.dim() != 2 or tiles.shape[1] != 2 or tiles.device != q.device:
            raise ValueError(
                f"paged_prefill: tiles must be [N, 2] int32 on {q.device}, got {tiles.dtype} {tuple(tiles.shape)}"
            )
        if not tiles.is_contiguous():
            raise ValueError("paged_prefill: tiles must be contiguous")
        if tiles.shape[0] == 0:
            return out
        if tile_count is None:
            tile_count = torch.full((1,), tiles.shape[0], dtype=torch.int32, device=q.device)
        elif tile_count.dtype != torch.int32 or tile_count.shape != (1,) or tile_count.device != q.device:
            raise ValueError(f"paged_prefill: tile_count must be [1] int32 on {q.device}, got {tile_count.dtype} "
                             f"{tuple(tile_count.shape)} on {tile_count.device}")  # fmt: skip
        # Programs for the tiles q's rows fill, plus two partial ones; each loops if there are more.
        grid = (min(tiles.shape[0], triton.cdiv(q.shape[0], block_q) + 2), 1, kv_heads)
    if num_splits > 1:
        part_acc = torch.empty((q.shape[0], q.shape[1], num_splits, consts["BLOCK_D"]), dtype=torch.float32,
                               device=q.device)  # fmt: skip
        part_ml = torch.empty((q.shape[0], q.shape[1], num_splits, 2), dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused: every tile writes out itself
    tile_args = dict(TILED=tiles is not None, SKIP_SINGLE=skip_single, NUM_SPLITS=num_splits,
                     SPLIT_MIN_TILES=PREFILL_SPLIT_MIN_TILES)  # fmt: skip
    tile_table = query_start_loc if tiles is None else tiles
    count = query_start_loc if tile_count is None else tile_count  # unused untiled
    paged_prefill_kernel[(grid[0] * num_splits, grid[1], grid[2])](
        out,
        part_acc,
        part_ml,
        q,
        cache_k,
        cache_v,
        block_tables,
        seq_lens,
        query_start_loc,
        tile_table,
        count,
        **_strides(q, out, cache_k, cache_v, block_tables),
        **consts,
        BLOCK_G=block_g,
        BLOCK_Q=block_q,
        BLOCK_M=block_q * block_g,
        BLOCK_N=block_n,
        **tile_args,
        **extra,
    )
    if num_splits > 1:
        paged_prefill_merge_kernel[grid](
            out,
            part_acc,
            part_ml,
            tile_table,
            count,
            query_start_loc,
            seq_lens,
            out.stride(0),
            out.stride(1),
            consts["window"],
            GROUP=consts["GROUP"],
            BLOCK_G=block_g,
            BLOCK_Q=block_q,
            BLOCK_M=block_q * block_g,
            HEAD_DIM=consts["HEAD_DIM"],
            BLOCK_D=consts["BLOCK_D"],
            BLOCK_N=block_n,
            HAS_WINDOW=consts["HAS_WINDOW"],
            **tile_args,
            **({} if interp else {"num_warps": 4}),
        )
    return out


def paged_attention(
    q: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    sliding_window: int | None = None,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,
    softcap: float | None = None,
    tiles: torch.Tensor | None = None,
    single_rows: bool = True,
    tile_count: torch.Tensor | None = None,
) -> torch.Tensor:
    """Paged attention of one step: ``paged_decode`` when every sequence has one query token
    (``max_query_len == 1``), else ``paged_prefill`` for the sequences of several tokens and, when
    ``single_rows`` (some sequences may have one token: a mixed step's decodes), ``paged_decode``
    over ``query_start_loc`` for those (the prefill kernel would give each its own BLOCK_Q-row tile).
    Semantics and shapes: the module docstring.

    ``max_seq_len`` (optional upper bound on seq_lens) only tunes decode's split count; ``softcap``
    caps the scores (``cap * tanh(s / cap)``, Gemma 2); ``tiles`` and ``tile_count``
    (``paged_prefill``'s) always select the tiled prefill kernel.
    """
    if tiles is None and max_query_len == 1 and q.shape[0] == seq_lens.shape[0]:
        return paged_decode(
            q,
            cache_k,
            cache_v,
            block_tables,
            seq_lens,
            scale,
            sliding_window,
            max_seq_len=max_seq_len,
            out=out,
            softcap=softcap,
        )
    out = paged_prefill(
        q,
        cache_k,
        cache_v,
        block_tables,
        seq_lens,
        query_start_loc,
        max_query_len,
        scale,
        sliding_window,
        out=out,
        softcap=softcap,
        tiles=tiles,
        skip_single=single_rows,
        tile_count=tile_count,
    )
    if single_rows:
        paged_decode(
            q,
            cache_k,
            cache_v,
            block_tables,
            seq_lens,
            scale,
            sliding_window,
            out=out,
            softcap=softcap,
            query_start_loc=query_start_loc,
        )
    return out


__all__ = [
    "decode_num_splits",
    "paged_attention",
    "paged_decode",
    "paged_prefill",
    "prefill_block_q",
    "prefill_num_splits",
    "prefill_tiles",
]
