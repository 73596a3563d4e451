"""The Triton programs of paged attention (device code only): one tile walk (``_attend``), the decode
kernel with its split-merge kernel (flash-decoding), and the ragged prefill kernel with its own
merge kernel for query tiles whose keys are split over programs. Their semantics,
shapes and the way they tile the work are in ``kernels/paged_attention.py``, which validates the
inputs and launches them.
"""

from __future__ import annotations

import triton
import triton.language as tl

_NEG = tl.constexpr(-1.0e30)  # finite "minus infinity": a fully masked tile never makes exp(-inf - -inf) = NaN
# (a constexpr: compiled Triton refuses plain Python globals inside @triton.jit functions)
_PER_STEP_INTS = ("stride_bt", "max_blocks")
"""The block table's width, which an eager step sizes to its longest sequence: not compile-time
specialised (Triton would otherwise compile a variant per class of it, 1 / a multiple of 16 / other,
inside the step that first meets one; ``worker/eager_warmup.py``)."""


@triton.jit
def _key_tile(
    q,
    acc,
    l_i,
    m_i,
    pos,
    start,
    hi,
    window,
    cache_k,
    cache_v,
    bt_row,
    max_blocks,
    kvh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    qk_scale,
    cap_log2,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    MASKED: tl.constexpr,
):
    """``_attend``'s online-softmax update by the key tile at ``start``: MASKED, keys past ``hi`` or the
    block table and keys a row may not see (causal, window) get no weight; unmasked, every key of the
    tile is in range and visible to every row (``_attend`` says which tiles)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    keys = start + offs_n
    col = keys // BLOCK_SIZE
    if MASKED:
        k_ok = (keys < hi) & (col < max_blocks)
        page = tl.load(bt_row + col, mask=k_ok, other=0).to(tl.int64)
        kv_ok = k_ok[:, None] & d_ok[None, :]
    else:
        page = tl.load(bt_row + col).to(tl.int64)
        kv_ok = d_ok[None, :]
    within = (keys % BLOCK_SIZE).to(tl.int64)
    k = tl.load(
        cache_k + page[:, None] * stride_kb + within[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :],
        mask=kv_ok,
        other=0.0,
    )
    v = tl.load(
        cache_v + page[:, None] * stride_vb + within[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :],
        mask=kv_ok,
        other=0.0,
    )
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [M, N], log2 domain
    if HAS_SOFTCAP:
        # tanh(x) = 1 - 2 / (exp(2x) + 1): exact limits +-1, no tanh intrinsic needed.
        s = cap_log2 * (1.0 - 2.0 / (tl.exp(2.0 * s) + 1.0))
    if MASKED:
        visible = (keys[None, :] <= pos[:, None]) & k_ok[None, :]
        if HAS_WINDOW:
            visible = visible & (keys[None, :] > pos[:, None] - window)
        s = tl.where(visible, s, _NEG)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    if MASKED:
        p = tl.where(visible, tl.exp2(s - m_new[:, None]), 0.0)
    else:
        p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, l_i, m_new


@triton.jit
def _attend(
    q,
    acc,
    l_i,
    m_i,
    pos,
    first,
    cache_k,
    cache_v,
    bt_row,
    max_blocks,
    kvh,
    lo,
    hi,
    window,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    qk_scale,
    cap_log2,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    UNMASKED_FIRST: tl.constexpr,
):
    """Online softmax of the rows of ``q`` (positions ``pos``, the smallest ``first``) over keys
    [lo, hi) of one sequence.

    Scores in log2 units: ``qk_scale * q.k`` (qk_scale = scale * log2 e), or with a soft-cap
    ``cap_log2 * tanh(qk_scale * q.k)`` (qk_scale = scale / cap, cap_log2 = cap * log2 e).

    UNMASKED_FIRST (the prefill kernel): key tiles that every row sees whole (all keys <= ``first``,
    no window) skip the causal mask and the bounds checks, in a loop before the masked tiles. It
    computes what the masked loop would for those tiles (the mask would select every score). The
    decode kernel keeps the one masked loop (a second loop would restart its memory pipeline for
    the last tile, and its scores are few)."""
    whole = lo
    if UNMASKED_FIRST:  # compiled out of the decode kernel
        if not HAS_WINDOW:
            whole = tl.maximum(tl.minimum(lo + tl.maximum(first + 1 - lo, 0) // BLOCK_N * BLOCK_N, hi), lo)
        for start in range(lo, whole, BLOCK_N):
            acc, l_i, m_i = _key_tile(
                q, acc, l_i, m_i, pos, start, hi, window, cache_k, cache_v, bt_row, max_blocks, kvh, stride_kb,
                stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, qk_scale, cap_log2, HAS_WINDOW, HAS_SOFTCAP,
                BLOCK_SIZE, BLOCK_N, HEAD_DIM, BLOCK_D, UPCAST, PRECISION, False,
            )  # fmt: skip
    for start in range(whole, hi, BLOCK_N):
        acc, l_i, m_i = _key_tile(
            q, acc, l_i, m_i, pos, start, hi, window, cache_k, cache_v, bt_row, max_blocks, kvh, stride_kb,
            stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, qk_scale, cap_log2, HAS_WINDOW, HAS_SOFTCAP,
            BLOCK_SIZE, BLOCK_N, HEAD_DIM, BLOCK_D, UPCAST, PRECISION, True,
        )  # fmt: skip
    return acc, l_i, m_i


@triton.jit(do_not_specialize=_PER_STEP_INTS)
def paged_decode_kernel(
    out,
    part_acc,
    part_ml,
    q,
    cache_k,
    cache_v,
    block_tables,
    seq_lens,
    query_start_loc,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bt,
    max_blocks,
    qk_scale,
    cap_log2,
    window,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    RAGGED: tl.constexpr,
):
    """Grid (B, H_kv, NUM_SPLITS): sequence b's one token, query heads of kv head kvh, one split.
    RAGGED (NUM_SPLITS 1): sequence b's token is row query_start_loc[b] of a mixed batch; sequences
    of other than one token exit (the prefill kernel's, ``SKIP_SINGLE``)."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    b64 = b.to(tl.int64)
    row = b64
    if RAGGED:
        t0 = tl.load(query_start_loc + b)
        if tl.load(query_start_loc + b + 1) - t0 != 1:
            return
        row = t0.to(tl.int64)
    seq_len = tl.load(seq_lens + b)
    p_last = seq_len - 1
    lo = seq_len * 0
    if HAS_WINDOW:
        lo = tl.maximum(p_last - window + 1, 0)
    lo = (lo // BLOCK_N) * BLOCK_N  # page-aligned tiles when BLOCK_N is a multiple of block_size
    hi = seq_len
    if NUM_SPLITS > 1:
        per = tl.cdiv(tl.cdiv(hi - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = lo + split * per
        hi = tl.minimum(hi, lo + per)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + offs_g
    row_ok = (offs_g < GROUP)[:, None] & (offs_d < HEAD_DIM)[None, :]
    qt = tl.load(q + row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :], mask=row_ok, other=0.0)
    if UPCAST:
        qt = qt.to(tl.float32)
    pos = tl.zeros([BLOCK_G], dtype=tl.int32) + p_last
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    m_i = tl.zeros([BLOCK_G], dtype=tl.float32) + _NEG
    acc, l_i, m_i = _attend(
        qt,
        acc,
        l_i,
        m_i,
        pos,
        p_last,
        cache_k,
        cache_v,
        block_tables + b64 * stride_bt,
        max_blocks,
        kvh,
        lo,
        hi,
        window,
        stride_kb,
        stride_kt,
        stride_kh,
        stride_vb,
        stride_vt,
        stride_vh,
        qk_scale,
        cap_log2,
        HAS_WINDOW,
        HAS_SOFTCAP,
        BLOCK_SIZE,
        BLOCK_N,
        HEAD_DIM,
        BLOCK_D,
        UPCAST,
        PRECISION,
        False,  # UNMASKED_FIRST
    )
    if NUM_SPLITS == 1:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            out + row * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
            o.to(out.dtype.element_ty),
            mask=row_ok,
        )
    else:
        # part_acc [B, H, NUM_SPLITS, BLOCK_D] and part_ml [B, H, NUM_SPLITS, 2] (m, l), contiguous.
        rows = (b64 * (tl.num_programs(1) * GROUP) + heads) * NUM_SPLITS + split
        tl.store(part_acc + rows[:, None] * BLOCK_D + offs_d[None, :], acc, mask=row_ok)
        g_ok = offs_g < GROUP
        tl.store(part_ml + rows * 2, m_i, mask=g_ok)
        tl.store(part_ml + rows * 2 + 1, l_i, mask=g_ok)


@triton.jit
def paged_decode_reduce_kernel(
    out,
    part_acc,
    part_ml,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """Grid (B, H): merge the NUM_SPLITS partial softmaxes of (sequence b, head h)."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < NUM_SPLITS
    rows = (b * tl.num_programs(1) + h) * NUM_SPLITS + offs_s
    m = tl.load(part_ml + rows * 2, mask=s_ok, other=_NEG)
    l_s = tl.load(part_ml + rows * 2 + 1, mask=s_ok, other=0.0)
    acc = tl.load(part_acc + rows[:, None] * BLOCK_D + offs_d[None, :], mask=s_ok[:, None], other=0.0)
    w = tl.exp2(m - tl.max(m, 0))
    total = tl.sum(w * l_s, 0)
    o = tl.sum(w[:, None] * acc, 0) / tl.where(total > 0, total, 1.0)
    tl.store(out + b * stride_ot + h * stride_oh + offs_d, o.to(out.dtype.element_ty), mask=offs_d < HEAD_DIM)


@triton.jit
def _prefill_program(
    unit,
    tiles,
    query_start_loc,
    seq_lens,
    window,
    TILED: tl.constexpr,
    SKIP_SINGLE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """The (sequence, query tile) a prefill program computes and the keys it attends to, as the
    prefill and merge kernels both see them: ``(q_start, q_len, qtile, first, lo, hi, live, b)``.
    ``unit`` is the program's row of ``tiles`` (TILED) or its query tile (untiled: the sequence is
    program_id(1)). ``first`` is the tile's first position; its keys are [lo, hi) (lo aligned down to
    BLOCK_N); ``live`` is False for programs with nothing to compute: idle tile rows (sequence -1),
    tiles past the sequence's tokens and, with SKIP_SINGLE, sequences of one token (the decode
    kernel's, ``RAGGED``)."""
    if TILED:
        b = tl.load(tiles + 2 * unit)  # the table's rows are few: int32 offsets
        qtile = tl.load(tiles + 2 * unit + 1)
    else:
        b = tl.program_id(1)
        qtile = unit
    live = b >= 0
    b = tl.maximum(b, 0)
    q_start = tl.load(query_start_loc + b)
    q_len = tl.load(query_start_loc + b + 1) - q_start
    live = live & (qtile * BLOCK_Q < q_len)
    if SKIP_SINGLE:
        live = live & (q_len != 1)
    seq_len = tl.load(seq_lens + b)
    first = seq_len - q_len + qtile * BLOCK_Q
    hi = tl.minimum(first + BLOCK_Q, seq_len)  # one past the tile's last real position
    lo = first * 0
    if HAS_WINDOW:
        lo = tl.maximum(first - window + 1, 0)
    lo = (lo // BLOCK_N) * BLOCK_N
    return q_start, q_len, qtile, first, lo, hi, live, b


@triton.jit
def _prefill_rows(
    q_start,
    q_len,
    qtile,
    first,
    kvh,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """A tile's BLOCK_M rows, BLOCK_Q tokens x BLOCK_G query heads of kv head ``kvh``:
    ``(tok, heads, pos, r_ok, tile_ok)``, each row's token row in q / out, query head and position,
    and the masks of real rows and of their [rows, BLOCK_D] elements."""
    offs_r = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    qi = qtile * BLOCK_Q + offs_r // BLOCK_G  # query token within the sequence
    g = offs_r % BLOCK_G
    r_ok = (qi < q_len) & (g < GROUP)
    tile_ok = r_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    return (q_start + qi).to(tl.int64), kvh * GROUP + g, first + offs_r // BLOCK_G, r_ok, tile_ok


@triton.jit
def _split_keys(lo, hi, split, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, MIN_TILES: tl.constexpr):
    """How many of the launch's NUM_SPLITS key splits a query tile uses (each at least MIN_TILES key
    tiles, so a short context stays in one program) and split ``split``'s keys [s_lo, s_hi): whole
    BLOCK_N tiles from lo (a split past the end gets none). One split keeps [lo, hi) as it is."""
    used = tl.maximum(tl.minimum(tl.cdiv(hi - lo, MIN_TILES * BLOCK_N), NUM_SPLITS), 1)
    per = tl.cdiv(tl.cdiv(hi - lo, used), BLOCK_N) * BLOCK_N
    s_lo = lo + split * per
    return used, s_lo, tl.minimum(hi, s_lo + per)


@triton.jit
def _prefill_work(
    unit,
    split,
    out,
    part_acc,
    part_ml,
    q,
    cache_k,
    cache_v,
    block_tables,
    seq_lens,
    query_start_loc,
    tiles,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bt,
    max_blocks,
    qk_scale,
    cap_log2,
    window,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    TILED: tl.constexpr,
    SKIP_SINGLE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLIT_MIN_TILES: tl.constexpr,
):
    """One work item of the prefill kernel: key split ``split`` of query tile ``unit`` (a row of
    ``tiles``, or the untiled grid's query tile), for kv head program_id(2)."""
    q_start, q_len, qtile, first, lo, hi, live, b = _prefill_program(
        unit, tiles, query_start_loc, seq_lens, window, TILED, SKIP_SINGLE, HAS_WINDOW, BLOCK_Q, BLOCK_N
    )
    used, s_lo, s_hi = _split_keys(lo, hi, split, NUM_SPLITS, BLOCK_N, SPLIT_MIN_TILES)
    if live & (split < used):
        kvh = tl.program_id(2)
        tok, heads, pos, r_ok, tile_ok = _prefill_rows(
            q_start, q_len, qtile, first, kvh, GROUP, BLOCK_G, BLOCK_Q, BLOCK_M, HEAD_DIM, BLOCK_D
        )
        offs_d = tl.arange(0, BLOCK_D)
        qt = tl.load(
            q + tok[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :], mask=tile_ok, other=0.0
        )
        if UPCAST:
            qt = qt.to(tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + _NEG
        acc, l_i, m_i = _attend(
            qt,
            acc,
            l_i,
            m_i,
            pos,
            first,
            cache_k,
            cache_v,
            block_tables + b.to(tl.int64) * stride_bt,
            max_blocks,
            kvh,
            s_lo,
            s_hi,
            window,
            stride_kb,
            stride_kt,
            stride_kh,
            stride_vb,
            stride_vt,
            stride_vh,
            qk_scale,
            cap_log2,
            HAS_WINDOW,
            HAS_SOFTCAP,
            BLOCK_SIZE,
            BLOCK_N,
            HEAD_DIM,
            BLOCK_D,
            UPCAST,
            PRECISION,
            True,  # UNMASKED_FIRST
        )
        if used == 1:
            o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(
                out + tok[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                o.to(out.dtype.element_ty),
                mask=tile_ok,
            )
        else:
            rows = (tok * (tl.num_programs(2) * GROUP) + heads) * NUM_SPLITS + split
            tl.store(part_acc + rows[:, None] * BLOCK_D + offs_d[None, :], acc, mask=tile_ok)
            tl.store(part_ml + rows * 2, m_i, mask=r_ok)
            tl.store(part_ml + rows * 2 + 1, l_i, mask=r_ok)


@triton.jit(do_not_specialize=_PER_STEP_INTS)
def paged_prefill_kernel(
    out,
    part_acc,
    part_ml,
    q,
    cache_k,
    cache_v,
    block_tables,
    seq_lens,
    query_start_loc,
    tiles,
    tile_count,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bt,
    max_blocks,
    qk_scale,
    cap_log2,
    window,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    TILED: tl.constexpr,
    SKIP_SINGLE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLIT_MIN_TILES: tl.constexpr,
):
    """Grid (cdiv(max_query_len, BLOCK_Q) * NUM_SPLITS, B, H_kv): BLOCK_Q tokens of sequence b x one
    head group x one key split. TILED: grid (G, 1, H_kv) over the work items (tile, split) of the
    first ``tile_count[0]`` rows of ``tiles`` (each a (b, query tile); b < 0: none), program p taking
    items p, p + G, ...: the grid is fixed by the step's token bound (a CUDA graph's) while only real
    tiles cost a program, and each computes exactly what the untiled program of the same (b, tile,
    split) does. SKIP_SINGLE: sequences of one token are skipped (the decode kernel takes their rows,
    ``RAGGED``). A tile that uses one split (``_split_keys``) writes its rows of out; one that uses
    several writes each split's unnormalised partial softmax to part_acc / part_ml
    ([T, H, NUM_SPLITS, BLOCK_D] and [T, H, NUM_SPLITS, 2], float32) for the merge kernel."""
    if TILED:
        end, step = tl.load(tile_count) * NUM_SPLITS, tl.num_programs(0)
    else:
        end, step = tl.program_id(0) + 1, 1  # the program's own item
    for w in range(tl.program_id(0), end, step):
        _prefill_work(
            w // NUM_SPLITS, w % NUM_SPLITS, out, part_acc, part_ml, q, cache_k, cache_v, block_tables, seq_lens,
            query_start_loc, tiles, stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_kt, stride_kh,
            stride_vb, stride_vt, stride_vh, stride_bt, max_blocks, qk_scale, cap_log2, window, GROUP, BLOCK_G,
            BLOCK_Q, BLOCK_M, HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N, HAS_WINDOW, HAS_SOFTCAP, UPCAST, PRECISION,
            TILED, SKIP_SINGLE, NUM_SPLITS, SPLIT_MIN_TILES,
        )  # fmt: skip


@triton.jit
def _merge_work(
    unit,
    out,
    part_acc,
    part_ml,
    tiles,
    query_start_loc,
    seq_lens,
    stride_ot,
    stride_oh,
    window,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    TILED: tl.constexpr,
    SKIP_SINGLE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLIT_MIN_TILES: tl.constexpr,
):
    """Query tile ``unit``'s rows of out from its splits' partial softmaxes, merged in split order,
    when it used several (else the prefill program wrote them)."""
    q_start, q_len, qtile, first, lo, hi, live, _b = _prefill_program(
        unit, tiles, query_start_loc, seq_lens, window, TILED, SKIP_SINGLE, HAS_WINDOW, BLOCK_Q, BLOCK_N
    )
    used, _s_lo, _s_hi = _split_keys(lo, hi, 0, NUM_SPLITS, BLOCK_N, SPLIT_MIN_TILES)
    if live & (used > 1):
        tok, heads, _pos, r_ok, tile_ok = _prefill_rows(
            q_start, q_len, qtile, first, tl.program_id(2), GROUP, BLOCK_G, BLOCK_Q, BLOCK_M, HEAD_DIM, BLOCK_D
        )
        offs_d = tl.arange(0, BLOCK_D)
        rows = (tok * (tl.num_programs(2) * GROUP) + heads) * NUM_SPLITS
        m = tl.zeros([BLOCK_M], dtype=tl.float32) + _NEG
        for s in range(NUM_SPLITS):
            ok = r_ok & (used > s + tl.zeros([BLOCK_M], dtype=tl.int32))
            m = tl.maximum(m, tl.load(part_ml + (rows + s) * 2, mask=ok, other=_NEG))
        total = tl.zeros([BLOCK_M], dtype=tl.float32)
        o = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        for s in range(NUM_SPLITS):
            ok = r_ok & (used > s + tl.zeros([BLOCK_M], dtype=tl.int32))
            w = tl.exp2(tl.load(part_ml + (rows + s) * 2, mask=ok, other=_NEG) - m)
            total += w * tl.load(part_ml + (rows + s) * 2 + 1, mask=ok, other=0.0)
            acc = tl.load(
                part_acc + (rows + s)[:, None] * BLOCK_D + offs_d[None, :], mask=ok[:, None] & tile_ok, other=0.0
            )
            o += w[:, None] * acc
        o = o / tl.where(total > 0, total, 1.0)[:, None]
        tl.store(
            out + tok[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
            o.to(out.dtype.element_ty),
            mask=tile_ok,
        )


@triton.jit
def paged_prefill_merge_kernel(
    out,
    part_acc,
    part_ml,
    tiles,
    tile_count,
    query_start_loc,
    seq_lens,
    stride_ot,
    stride_oh,
    window,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    TILED: tl.constexpr,
    SKIP_SINGLE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLIT_MIN_TILES: tl.constexpr,
):
    """Grid (cdiv(max_query_len, BLOCK_Q), B, H_kv), or (G, 1, H_kv) looping over the first
    ``tile_count[0]`` rows of ``tiles`` (TILED): the prefill kernel's tiles without their splits
    (``_merge_work``)."""
    if TILED:
        end, step = tl.load(tile_count), tl.num_programs(0)
    else:
        end, step = tl.program_id(0) + 1, 1  # the program's own tile
    for u in range(tl.program_id(0), end, step):
        _merge_work(
            u, out, part_acc, part_ml, tiles, query_start_loc, seq_lens, stride_ot, stride_oh, window, GROUP, BLOCK_G,
            BLOCK_Q, BLOCK_M, HEAD_DIM, BLOCK_D, BLOCK_N, HAS_WINDOW, TILED, SKIP_SINGLE, NUM_SPLITS, SPLIT_MIN_TILES,
        )  # fmt: skip
