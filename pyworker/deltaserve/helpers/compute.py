"""The LoRA math of a helper job, in numpy (a helper imports numpy, not torch: it starts in a
fraction of a second and holds a few MB).

Semantics (the torch reference ``kernels.lora.lora_shrink_ref`` / ``lora_expand_ref``, per slice)::

    for each slice s of the module the adapter adapts in this layer (r = rank[layer][s] > 0):
        A   = rows [0, r) of the slice's A block      [r, in_dim]   (host copy, read in place)
        B^T = rows [0, r) of the slice's B^T block    [r, out_dim]
        v   = dtype(float32(x) @ float32(A)^T)        the shrink output, rounded to the model dtype
        res[:, cols(s)] = scale * (float32(v) @ float32(B^T))
    res[:, other columns] = 0

The worker then does ``out[rows] = dtype(float32(out[rows]) + res)``: the reference's expand.
"""

from __future__ import annotations

import numpy as np

from .protocol import AdapterEntry, ModelSpec

RAW_DTYPES = {0: np.float32, 1: np.float16, 2: np.uint16}
"""How elements of each ``DTYPE_CODES`` are stored (bfloat16 as its raw 16 bits)."""


def to_f32(raw: np.ndarray, code: int) -> np.ndarray:
    """float32 values of ``raw`` elements of dtype ``code`` (a view for float32)."""
    if code == 0:
        return raw
    if code == 1:
        return raw.astype(np.float32)
    return (raw.astype(np.uint32) << 16).view(np.float32)


def round_to(v: np.ndarray, code: int) -> np.ndarray:
    """``v`` (float32) rounded to dtype ``code`` and back (round to nearest even, as torch casts)."""
    if code == 0:
        return v
    if code == 1:
        return v.astype(np.float16).astype(np.float32)
    u = v.view(np.uint32)
    rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return rounded.view(np.float32)


def adapter_weights(arena: np.ndarray, entry: AdapterEntry) -> np.ndarray:
    """``[layers, packed_elems]`` view of ``entry``'s host copy inside ``arena`` (uint8, no copy)."""
    raw = RAW_DTYPES[entry.dtype]
    n = entry.layers * entry.packed_elems
    nbytes = n * np.dtype(raw).itemsize
    return arena[entry.offset : entry.offset + nbytes].view(raw).reshape(entry.layers, entry.packed_elems)


def module_delta(
    x: np.ndarray,
    weights: np.ndarray,
    entry: AdapterEntry,
    spec: ModelSpec,
    layer: int,
    module: int,
    out: np.ndarray,
) -> None:
    """Writes ``res`` of the module docstring into ``out`` ([rows, out_width] float32) for ``x``
    ([rows, in_dim] float32) and ``entry``'s weights (its ``adapter_weights``)."""
    out[:] = 0.0
    _, slices = spec.modules[module]
    code = entry.dtype
    for index, col, size in slices:
        placed = entry.slices.get(index)
        r = entry.rank[layer][index] if placed is not None else 0
        if r == 0 or placed is None:
            continue
        start, r_p, fin, fout = placed
        row = weights[layer]
        a = to_f32(row[start : start + r * fin], code).reshape(r, fin)
        b_start = start + r_p * fin
        bt = to_f32(row[b_start : b_start + r * fout], code).reshape(r, fout)
        v = round_to(np.ascontiguousarray(x @ a.T), code)
        np.multiply(v @ bt, np.float32(entry.scale[layer][index]), out=out[:, col : col + size])


def profile_macs_per_ms(width: int, tokens: int = 64, rank: int = 16, reps: int = 5) -> float:
    """Multiply-adds per millisecond this core reaches on a shrink + expand of ``tokens`` rows at
    ``rank`` over ``width``-wide rows (the best of ``reps``; the first run warms up)."""
    import time

    rng = np.random.default_rng(0)
    x = rng.standard_normal((tokens, width), dtype=np.float32)
    a = rng.standard_normal((rank, width), dtype=np.float32)
    bt = rng.standard_normal((rank, width), dtype=np.float32)
    best = float("inf")
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        _ = (x @ a.T) @ bt
        best = min(best, time.perf_counter() - t0)
    macs = 2 * tokens * rank * width
    return macs / max(best * 1e3, 1e-6)


__all__ = ["RAW_DTYPES", "adapter_weights", "module_delta", "profile_macs_per_ms", "round_to", "to_f32"]
