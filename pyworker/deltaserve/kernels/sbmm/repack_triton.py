"""The repacked slot layout written in one Triton launch: ``convert_triton``, ``repack``'s and ``unpack``'s CUDA path.

``repack.py`` owns the layout (its module docstring draws it) and its torch code is the reference this
kernel equals word for word (tests/kernels/test_sbmm_repack.py); a ``store`` into a repacked pool was a
dozen torch launches per linear and launch-bound. Here one launch moves a linear's four tensors, each
program whole destination words of one of them (programs ``[0, A)`` the codes, ``[A, A + B)`` the 2:4
metadata, the rest the scales and zeros). The layout is cut into units, each a small transpose between
a few plain words and the repacked words that hold the same values:

    codes     unit (rb, stage, warp, KP, mt, g): plain words P[jrow][w] = word 2 KP + w of the stage in row
              128 rb + 32 warp + 16 mt + 8 jrow + g  <->  repacked words F[t] = 4 unit + t (t = 0..3);
              code (t, h, ko, jhi, jrow) sits in P[jrow][w] at code 8 jhi + 2 t + h (2-bit: w = ko) or
              2 t + h (4-bit: w = jhi), and in F[t] at field ((h KO + ko) 2 + jhi) 2 + jrow
    qindices  unit (rb, stage, warp, ks, mt, g): plain words P[jrow] = word 8 stage + ks of row (as above)
              <->  repacked F[t01] = 2 unit + t01: half t01 of P[0] low, of P[1] high (its own inverse)
    scales,   unit (rb, stage, warp, gi, g): plain element GS stage + gi of the rows (mt, jrow)
    zeros     <->  repacked halves 4 unit + 2 mt + jrow

Semantics::

    convert_triton(p, dst, to_frag=True)  == repack(p, dst) through torch (repack.py), in one launch
    convert_triton(p, dst, to_frag=False) == unpack(p, dst)

Shape:
    p, dst: PackedLinear of one config and shape that ``repack.fits``, contiguous tensors on one device
            (``dst`` may be a pool slot's views), not overlapping; CPU tensors need ``TRITON_INTERPRET=1``
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...formats.packed_delta import PackedLinear
from . import repack as layout

_BLOCK = 1024
"""Units per program (a few per thread: few programs, which the CPU interpreter runs one at a time)."""

assert (layout._CODE_ORDER, layout._QI_ORDER, layout._G_ORDER) == (
    (0, 5, 1, 6, 2, 4, 9, 10, 11, 7, 8, 3),
    (0, 5, 1, 6, 2, 4, 7, 3),
    (0, 5, 1, 6, 4, 2, 3),
), "repack.py's orders changed: the units above (and the kernel) follow the old ones"


@triton.jit
def _code_word(w0, w1, w2, w3, o: tl.constexpr, BITS: tl.constexpr, TO_FRAG: tl.constexpr):
    """Output word ``o`` of a codes unit (F[t = o] from P[jrow][w] = w{2 jrow + w}, or P[o] from F[t] =
    w{t}), every field gathered from its constant place in the unit (module docstring), uint32."""
    PER: tl.constexpr = 32 // BITS
    KO: tl.constexpr = 4 // BITS  # k-steps per repacked word: 2-bit 2, 4-bit 1
    MASK: tl.constexpr = (1 << BITS) - 1
    acc = tl.zeros_like(w0)
    for q in tl.static_range(PER):
        if TO_FRAG:  # o = t; q = field ((h KO + ko) 2 + jhi) 2 + jrow
            jrow = q % 2
            jhi = (q // 2) % 2
            ko = (q // 4) % KO
            h = q // (4 * KO)
            if BITS == 2:
                i = 2 * jrow + ko
                pos = 8 * jhi + 2 * o + h
            else:
                i = 2 * jrow + jhi
                pos = 2 * o + h
        else:  # o = 2 jrow + w; q = code of the plain word
            jrow = o // 2
            t = (q // 2) % 4
            h = q % 2
            if BITS == 2:
                jhi = q // 8
                ko = o % 2
            else:
                jhi = o % 2
                ko = 0
            i = t
            pos = ((h * KO + ko) * 2 + jhi) * 2 + jrow
        if i == 0:
            src = w0
        elif i == 1:
            src = w1
        elif i == 2:
            src = w2
        else:
            src = w3
        if q >= pos:  # field pos of src -> field q
            acc |= (src << ((q - pos) * BITS)) & (MASK << (q * BITS))
        else:
            acc |= (src >> ((pos - q) * BITS)) & (MASK << (q * BITS))
    return acc


@triton.jit
def _move_codes(src, dst, u, live, stages, BITS: tl.constexpr, KPN: tl.constexpr, TO_FRAG: tl.constexpr):
    """Codes units ``u`` (int32 words; module docstring): load the four input words, store the four outputs."""
    g = u % 8
    mt = (u // 8) % 2
    kp = (u // 16) % KPN
    warp = (u // (16 * KPN)) % 4
    rest = u // (64 * KPN)
    stage = rest % stages
    rb = rest // stages
    row_words = stages * 2 * KPN  # plain words per row
    plain = (rb * 128 + warp * 32 + mt * 16 + g) * row_words + stage * 2 * KPN + 2 * kp
    if TO_FRAG:
        i0 = plain
        i1 = plain + 1
        i2 = plain + 8 * row_words
        i3 = plain + 8 * row_words + 1
    else:
        i0 = 4 * u
        i1 = 4 * u + 1
        i2 = 4 * u + 2
        i3 = 4 * u + 3
    w0 = tl.load(src + i0, mask=live).to(tl.uint32, bitcast=True)
    w1 = tl.load(src + i1, mask=live).to(tl.uint32, bitcast=True)
    w2 = tl.load(src + i2, mask=live).to(tl.uint32, bitcast=True)
    w3 = tl.load(src + i3, mask=live).to(tl.uint32, bitcast=True)
    if TO_FRAG:
        o0 = 4 * u
        o1 = 4 * u + 1
        o2 = 4 * u + 2
        o3 = 4 * u + 3
    else:
        o0 = plain
        o1 = plain + 1
        o2 = plain + 8 * row_words
        o3 = plain + 8 * row_words + 1
    tl.store(dst + o0, _code_word(w0, w1, w2, w3, 0, BITS, TO_FRAG).to(tl.int32, bitcast=True), mask=live)
    tl.store(dst + o1, _code_word(w0, w1, w2, w3, 1, BITS, TO_FRAG).to(tl.int32, bitcast=True), mask=live)
    tl.store(dst + o2, _code_word(w0, w1, w2, w3, 2, BITS, TO_FRAG).to(tl.int32, bitcast=True), mask=live)
    tl.store(dst + o3, _code_word(w0, w1, w2, w3, 3, BITS, TO_FRAG).to(tl.int32, bitcast=True), mask=live)


@triton.jit
def _move_qindices(src, dst, u, live, stages, TO_FRAG: tl.constexpr):
    """2:4 metadata units ``u`` (int32 words): a 2 x 2 transpose of 16-bit halves, its own inverse."""
    g = u % 8
    mt = (u // 8) % 2
    ks = (u // 16) % 8
    warp = (u // 128) % 4
    rest = u // 512
    stage = rest % stages
    rb = rest // stages
    plain = (rb * 128 + warp * 32 + mt * 16 + g) * (stages * 8) + stage * 8 + ks
    if TO_FRAG:
        i0 = plain
        i1 = plain + 8 * stages * 8
        o0 = 2 * u
        o1 = 2 * u + 1
    else:
        i0 = 2 * u
        i1 = 2 * u + 1
        o0 = plain
        o1 = plain + 8 * stages * 8
    a = tl.load(src + i0, mask=live).to(tl.uint32, bitcast=True)
    b = tl.load(src + i1, mask=live).to(tl.uint32, bitcast=True)
    lo = (a & 0xFFFF) | (b << 16)
    hi = (a >> 16) | (b & 0xFFFF0000)
    tl.store(dst + o0, lo.to(tl.int32, bitcast=True), mask=live)
    tl.store(dst + o1, hi.to(tl.int32, bitcast=True), mask=live)


@triton.jit
def _move_groups(src_s, dst_s, src_z, dst_z, u, live, stages, GS: tl.constexpr, TO_FRAG: tl.constexpr):
    """Scales / zeros units ``u`` (16-bit elements): the four rows' values of a group, each a copy."""
    g = u % 8
    gi = (u // 8) % GS
    warp = (u // (8 * GS)) % 4
    rest = u // (32 * GS)
    stage = rest % stages
    rb = rest // stages
    row_groups = stages * GS
    plain = (rb * 128 + warp * 32 + g) * row_groups + stage * GS + gi
    for mt in tl.static_range(2):
        for jrow in tl.static_range(2):
            p = plain + (16 * mt + 8 * jrow) * row_groups
            f = 4 * u + 2 * mt + jrow
            if TO_FRAG:
                i = p
                o = f
            else:
                i = f
                o = p
            tl.store(dst_s + o, tl.load(src_s + i, mask=live), mask=live)
            tl.store(dst_z + o, tl.load(src_z + i, mask=live), mask=live)


@triton.jit
def _convert_kernel(
    src_v, dst_v, src_qi, dst_qi, src_s, dst_s, src_z, dst_z,
    code_units, qi_units, group_units, code_programs, qi_programs, stages,
    BITS: tl.constexpr, KPN: tl.constexpr, GS: tl.constexpr, TO_FRAG: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    if pid < code_programs:
        u = pid * BLOCK + tl.arange(0, BLOCK)
        _move_codes(src_v, dst_v, u, u < code_units, stages, BITS, KPN, TO_FRAG)
    elif pid < code_programs + qi_programs:
        u = (pid - code_programs) * BLOCK + tl.arange(0, BLOCK)
        _move_qindices(src_qi, dst_qi, u, u < qi_units, stages, TO_FRAG)
    else:
        u = (pid - code_programs - qi_programs) * BLOCK + tl.arange(0, BLOCK)
        _move_groups(src_s, dst_s, src_z, dst_z, u, u < group_units, stages, GS, TO_FRAG)


def convert_triton(p: PackedLinear, dst: PackedLinear, to_frag: bool) -> PackedLinear:
    """``dst`` = ``p`` repacked (``to_frag``) or unpacked (module docstring), in one launch; returns ``dst``.
    No checks: ``repack.py``'s ``repack`` / ``unpack`` check both and call this where Triton runs."""
    view = layout._codes_view(p.bits, p.sparse, p.out_features, p.in_features)
    stages, kpn = view[5], view[6]
    code_units = p.qvalues.numel() // 4
    qi_units = 0 if p.qindices is None else p.qindices.numel() // 2
    group_units = p.scales.numel() // 4
    code_programs, qi_programs = triton.cdiv(code_units, _BLOCK), triton.cdiv(qi_units, _BLOCK)
    grid = (code_programs + qi_programs + triton.cdiv(group_units, _BLOCK),)
    src_qi = p.qvalues if p.qindices is None else p.qindices  # dense: no metadata programs read it
    dst_qi = dst.qvalues if dst.qindices is None else dst.qindices
    _convert_kernel[grid](
        p.qvalues, dst.qvalues, src_qi, dst_qi,
        p.scales.view(torch.int16), dst.scales.view(torch.int16), p.zeros.view(torch.int16), dst.zeros.view(torch.int16),
        code_units, qi_units, group_units, code_programs, qi_programs, stages,
        BITS=p.bits, KPN=kpn, GS=layout.KS // p.group_size, TO_FRAG=to_frag, BLOCK=_BLOCK, num_warps=4,
    )  # fmt: skip
    return dst
