"""SBMM's CUDA C++ op, csrc/sbmm.cu, through ctypes (built by ``kernels.cuda_ext``; optional everywhere).

Tensor cores, packed words copied ahead with cp.async, coalesced (drawn in the .cu file's header):
work tiles of at most 16 tokens (a block computes the 8-token fragments its tile fills from one
dequantisation of its rows), float16 / bfloat16, in_features % 256 == 0, group size 32 / 64 / 128
(``cuda_supports`` says why a call does not fit; the Triton kernels run then). It also takes up to
three pools at once (``sbmm_stacked_cuda``: q, k, v of a fused qkv module, gate and up), one launch
for the module. When its blocks would leave room in one wave it splits K, and the split that finishes
last adds the partials (in split order: deterministic). It reads its per-slot half2 flags
(``DeltaWeights.half2_ok``) and, inside a CUDA-graph capture, the step's tile count
(``DeltaMeta.tile_count``) on the device, so one captured launch serves any later step as an eager
launch of that step would. It reads either slot layout (``DeltaWeights.layout``: the repacked one, one
contiguous run per block and stage, fields a lane turns into A registers with a shift and a LOP3, is what
pools that fit get on CUDA by default; layout.py says why). Its third entry point, ``deltaserve_dequant``,
is ``dequant.py``'s, over either layout too (csrc/sbmm_dequant.cuh).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch
import triton

from .. import cuda_ext
from ..common import sm_count, use_triton_for
from .checks import check_stacked
from .dequant import dense_segments
from .layout import DeltaWeights
from .meta import DeltaMeta

_CUDA_DTYPES = cuda_ext.DTYPE_CODES
"""Activation dtypes csrc/sbmm.cu takes, and their codes."""
_CUDA_ROWS = 128
"""Output rows per block of csrc/sbmm.cu (its ``ROWS``)."""
_CUDA_KS = 256
"""Input columns per pipelined stage of csrc/sbmm.cu (its ``KS``): K must be a multiple."""
_CUDA_GROUPS = (32, 64, 128)
"""Group sizes csrc/sbmm.cu takes (a stage's scales are copied as 4-byte pieces)."""
_CUDA_MAX_M = 16
"""Largest work tile csrc/sbmm.cu takes (its ``MAX_NT`` 8-token MMA fragments; why not more: its header)."""
CUDA_MAX_SLICES = 3
"""Most linears one CUDA launch takes (csrc/sbmm.cu ``MAX_SLICES``: q, k, v of a fused qkv)."""
_P = ctypes.c_void_p
_CUDA_ARGS = (
    [_P] * 7
    + [ctypes.POINTER(_P)] * 8
    + [ctypes.POINTER(ctypes.c_int)] * 2
    + [ctypes.c_int] * 3
    + [ctypes.c_int64] * 2
    + [ctypes.c_int] * 10
    + [_P]
)
"""``deltaserve_sbmm``'s C signature (csrc/sbmm.cu)."""
_CUDA_SPLIT_ARGS = [ctypes.c_int] * 4
"""``deltaserve_sbmm_split``'s C signature."""
_CUDA_OCCUPANCY_ARGS = [ctypes.c_int] * 6 + [ctypes.POINTER(ctypes.c_int)]
"""``deltaserve_sbmm_blocks_per_sm``'s C signature."""


def cuda_supports(x: torch.Tensor, w: DeltaWeights, meta: DeltaMeta) -> str | None:
    """None when csrc/sbmm.cu can run this call, else why not (then the Triton kernel runs)."""
    if meta.block_m > _CUDA_MAX_M:
        return f"work tiles of {meta.block_m} tokens (at most {_CUDA_MAX_M})"
    return cuda_shape_problem(x, w)


def cuda_shape_problem(x: torch.Tensor, w: DeltaWeights) -> str | None:
    """``cuda_supports`` for any metadata: why csrc/sbmm.cu cannot take activations like ``x`` (device,
    dtype) with pool ``w``, or None."""
    if not x.is_cuda:
        return "CPU tensors"
    if x.dtype not in _CUDA_DTYPES:
        return f"activations {x.dtype} (float16 / bfloat16 only)"
    if w.in_features % _CUDA_KS or w.group_size not in _CUDA_GROUPS:
        return (
            f"in_features {w.in_features} (want a multiple of {_CUDA_KS}) / group size {w.group_size} "
            f"(want one of {_CUDA_GROUPS})"
        )
    return w.cuda_alignment_problem()


def cuda_tile_cap(device: torch.device) -> int | None:
    """``DeltaMeta``'s ``max_block_m`` on ``device``, for decode and prefill steps alike: the CUDA op's
    largest tile where that op runs, else None (the Triton kernels' own tile sizes). A run of one delta
    then takes several CUDA tiles instead of Triton tiles of 64 tokens, which is faster though each
    16-token tile reads the delta again (bench/README.md)."""
    if device.type != "cuda" or not use_triton_for(device) or cuda_ext.library("sbmm") is None:
        return None
    return _CUDA_MAX_M


_slots: dict[tuple, int] = {}


def cuda_slots(lib: ctypes.CDLL, w: DeltaWeights, tile_tokens: int, dtype: torch.dtype) -> int:
    """Blocks of csrc/sbmm.cu's launch over pool ``w`` for work tiles of up to ``tile_tokens`` tokens that the
    device runs at once: the kernel's blocks per SM (its registers and shared memory, asked of the CUDA
    runtime once per kernel: a 16-token tile's stages hold twice the x rows, so over a plain-layout pool 3
    blocks fit an SM instead of 4) x SMs.
    K is split until a launch has this many blocks (``_cuda_split``)."""
    device = w.qvalues.device
    key = (w.bits, w.sparse, dtype, max(tile_tokens, 1), w.group_size, w.repacked, device)
    if key not in _slots:
        fn = lib.deltaserve_sbmm_blocks_per_sm
        if fn.argtypes is None:
            fn.argtypes, fn.restype = _CUDA_OCCUPANCY_ARGS, ctypes.c_int
        blocks = ctypes.c_int(0)
        with torch.cuda.device(device):
            code = fn(
                w.bits, int(w.sparse), _CUDA_DTYPES[dtype], key[3], w.group_size, int(w.repacked), ctypes.byref(blocks)
            )
        cuda_ext.check(lib, code, "sbmm_cuda occupancy")
        _slots[key] = max(blocks.value, 1) * sm_count(device)
    return _slots[key]


def _cuda_split(lib: ctypes.CDLL, row_blocks: int, tiles: int, in_features: int, slots: int) -> int:
    """K splits of a CUDA launch of ``row_blocks`` x ``tiles`` blocks when ``slots`` blocks run at once
    (csrc/sbmm.cu ``split_for``, the one copy of the rule: the most whose blocks fit one wave of ``slots``, each
    split >= 2 stages)."""
    fn = lib.deltaserve_sbmm_split
    if fn.argtypes is None:
        fn.argtypes, fn.restype = _CUDA_SPLIT_ARGS, ctypes.c_int
    return fn(row_blocks, tiles, in_features, slots)


def cuda_split(meta: DeltaMeta, w: DeltaWeights, dtype: torch.dtype = torch.float16) -> int | None:
    """K splits of ``sbmm_cuda``'s eager launch of ``meta`` over pool ``w`` with ``dtype`` activations (what a
    benchmark records with its timings); None where the CUDA op is unavailable (no CUDA device, no nvcc,
    turned off)."""
    device = w.qvalues.device
    lib = cuda_ext.library("sbmm") if device.type == "cuda" else None
    if lib is None:
        return None
    slots = cuda_slots(lib, w, meta.tile_tokens, dtype)
    return _cuda_split(lib, triton.cdiv(w.out_features, _CUDA_ROWS), meta.num_tiles, w.in_features, slots)


_counters: dict[torch.device, torch.Tensor] = {}
_outgrown: list[torch.Tensor] = []
"""Counter buffers replaced by larger ones: graphs captured over them still replay, so they stay allocated."""


def _split_counters(device: torch.device, n: int) -> torch.Tensor:
    """The CUDA op's split-K arrival counters on ``device`` (int32, at least ``n``; zero between launches:
    the last split of each block resets its counter). One buffer per device, so captured graphs keep its
    address; grown only outside a capture (the old one is kept for the graphs that read it)."""
    buf = _counters.get(device)
    if buf is None or buf.numel() < n:
        if torch.cuda.is_current_stream_capturing():
            kept = 0 if buf is None else buf.numel()
            raise RuntimeError(
                f"sbmm_cuda: split-K counters of {n} entries do not fit the {kept} kept; run the "
                "launch once before capturing it"
            )
        if buf is not None:
            _outgrown.append(buf)
        buf = _counters[device] = torch.zeros(max(n, 1 << 16), dtype=torch.int32, device=device)
    return buf


def sbmm_cuda(x: torch.Tensor, out: torch.Tensor, w: DeltaWeights, meta: DeltaMeta) -> torch.Tensor:
    """csrc/sbmm.cu for ``sbmm`` (no dispatch), in place on ``out``: one launch for all deltas. Raises when
    the op is unavailable or does not fit the call."""
    return sbmm_stacked_cuda(x, out, [(w, 0)], meta)


def sbmm_stacked_cuda(
    x: torch.Tensor, out: torch.Tensor, slices: Sequence[tuple[DeltaWeights, int]], meta: DeltaMeta
) -> torch.Tensor:
    """csrc/sbmm.cu for ``sbmm_stacked`` (no dispatch): every slice in one launch. Raises when the op is
    unavailable or does not fit the call."""
    check_stacked(x, out, slices, meta)
    if len({w.layout for w, _ in slices}) > 1:
        raise ValueError("sbmm_cuda: slices of one launch must share a layout (all plain or all repacked)")
    if len(slices) > CUDA_MAX_SLICES:
        raise ValueError(f"sbmm_cuda: {len(slices)} slices (one launch takes at most {CUDA_MAX_SLICES})")
    for w, _ in slices:
        why = cuda_supports(x, w, meta)
        if why is not None:
            raise ValueError(f"sbmm_cuda: unsupported call: {why}")
    lib = cuda_ext.library("sbmm")
    if lib is None:
        raise RuntimeError(f"sbmm_cuda: the CUDA op is unavailable: {cuda_ext.unavailable('sbmm')}")
    return launch_cuda(lib, x, out, slices, meta)


def launch_cuda(
    lib: ctypes.CDLL, x: torch.Tensor, out: torch.Tensor, slices: Sequence[tuple[DeltaWeights, int]], meta: DeltaMeta
) -> torch.Tensor:
    """The launch of ``sbmm_stacked_cuda``, for callers that checked the call, ``cuda_supports`` and the
    library. Eagerly the grid has the step's real tiles (the table lists them first) and its split; inside a
    CUDA-graph capture it has every row of the tile table and the most splits any tile count could want, and
    the blocks recompute the split from ``meta.tile_count`` at every replay (padding rows' blocks exit)."""
    for w, col in slices:
        if meta.dense:
            dense_segments(x, out[:, col : col + w.out_features], w, meta)
    w0 = slices[0][0]
    row_blocks = sum(triton.cdiv(w.out_features, _CUDA_ROWS) for w, _ in slices)
    counters = _split_counters(x.device, meta.grid_tiles * row_blocks)  # before any capture: graphs keep it
    capturing = torch.cuda.is_current_stream_capturing()
    if meta.num_tiles == 0 and not capturing:
        return out
    if x.stride(-1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
        x = x.contiguous()
    block_m = max(meta.tile_tokens, 1)
    slots = cuda_slots(lib, w0, block_m, x.dtype)
    if capturing:  # the most splits any step takes (one tile); the blocks split as the step wants
        split = _cuda_split(lib, row_blocks, 1, w0.in_features, slots)
        tile_count = meta.tile_count
    else:
        split = _cuda_split(lib, row_blocks, meta.num_tiles, w0.in_features, slots)
        tile_count = None  # the grid's split is the step's
    rows = meta.order.shape[0]  # partial sums by position in ``order``: a shape that depends on T only
    cols = max(col + w.out_features for w, col in slices)
    ws = torch.empty((split, rows, cols), dtype=torch.float32, device=x.device) if split > 1 else None
    n = len(slices)

    def ptrs(values: list) -> ctypes.Array:
        return (_P * n)(*values)

    fn = lib.deltaserve_sbmm
    if fn.argtypes is None:
        fn.argtypes, fn.restype = _CUDA_ARGS, ctypes.c_int
    half2 = x.dtype == torch.float16
    code = fn(
        x.data_ptr(), out.data_ptr(), None if ws is None else ws.data_ptr(),
        counters.data_ptr(), meta.order.data_ptr(), meta.tiles.data_ptr(),
        None if tile_count is None else tile_count.data_ptr(),
        *(ptrs([getattr(w, name).data_ptr() if name != "qindices" or w.sparse else None for w, _ in slices])
          for name in ("qvalues", "qindices", "scales", "zeros", "qvalues_offsets", "qindices_offsets",
                       "group_offsets")),
        ptrs([w.half2_flags.data_ptr() if half2 else None for w, _ in slices]),
        (ctypes.c_int * n)(*[w.out_features for w, _ in slices]), (ctypes.c_int * n)(*[col for _, col in slices]), n,
        w0.in_features, w0.group_size, x.stride(0), out.stride(0), w0.bits, int(w0.sparse), _CUDA_DTYPES[x.dtype],
        block_m, meta.grid_tiles if capturing else meta.num_tiles, split, rows, cols, slots,
        int(w0.repacked), torch.cuda.current_stream(x.device).cuda_stream,
    )  # fmt: skip
    cuda_ext.check(lib, code, "sbmm_cuda")
    return out
