"""What every kernel op shares: which implementation the entry points use, and bf16 rounding.

One setting for all ops (``set_backend``), so a worker runs either its Triton kernels or their
torch references, never a mix by accident:

    auto    Triton on CUDA tensors, the torch reference elsewhere (the default)
    torch   the torch references everywhere (A/B runs, debugging)
    triton  the Triton kernels everywhere; CPU tensors then need ``TRITON_INTERPRET=1`` set before
            triton is imported (the CPU tests do this in tests/conftest.py)

The worker sets it from its ``--kernels`` flag; tests call ``set_backend`` (and restore it).

Also shared: ``sm_count`` (launches size their grids by it) and ``read_launch_configs`` (tuned launch
configs are data files next to their op, ``<op package>/configs/*.json``, STYLE #23).
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl

BACKENDS = ("auto", "torch", "triton")
"""Accepted values of ``set_backend``."""

_backend = "auto"


def set_backend(name: str) -> str:
    """Selects the implementation of every op; returns the previous setting."""
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"kernel backend {name!r}: want one of {', '.join(BACKENDS)}")
    previous, _backend = _backend, name
    return previous


def get_backend() -> str:
    """The current setting (``auto``, ``torch`` or ``triton``)."""
    return _backend


def use_triton_for(device: torch.device) -> bool:
    """Whether ops on ``device`` run their Triton kernel under the current setting."""
    return device.type == "cuda" if _backend == "auto" else _backend == "triton"


def want_triton(op: str, x: torch.Tensor, use_triton: bool | None) -> bool:
    """The dispatch rule of the small ops' entry points.

    ``use_triton`` True / False forces the kernel / the torch reference for one call; None follows
    the backend setting. The kernel on CPU tensors needs ``TRITON_INTERPRET=1``.
    """
    if use_triton is None:
        use_triton = use_triton_for(x.device)
    if use_triton and not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(f"{op}: the Triton path needs CUDA tensors, or TRITON_INTERPRET=1 for CPU tensors")
    return use_triton


@triton.jit
def round_to(x, ty: tl.constexpr, RNE_BY_HAND: tl.constexpr):
    """float32 ``x`` rounded to dtype ``ty`` (round to nearest even), returned as float32.

    ``RNE_BY_HAND`` (``needs_rne_by_hand``) rounds to bfloat16 with integer ops: the interpreter's
    float32 -> bfloat16 cast truncates, while the compiled one (``cvt.rn``) rounds to nearest even.
    The result is exact in ``ty``, so a later ``.to(ty)`` is lossless either way.
    """
    if RNE_BY_HAND:
        u = x.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
        y = u.to(tl.float32, bitcast=True)
    else:
        y = x.to(ty).to(tl.float32)
    return y


def needs_rne_by_hand(t: torch.Tensor) -> bool:
    """``round_to``'s flag: a bfloat16 tensor the interpreter runs (CPU tensors only run there)."""
    return t.dtype == torch.bfloat16 and not t.is_cuda


@functools.cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of CUDA ``device``."""
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def _read_json(path: Path) -> str:
    return path.read_text()


def read_launch_configs(package_file: str, name: str = "launch.json") -> dict[str, Any]:
    """The launch configs of an op package: ``configs/<name>`` next to ``package_file`` (a module of the
    package: pass ``__file__``), parsed afresh (callers may change what they get); read from disk once."""
    return json.loads(_read_json(Path(package_file).resolve().parent / "configs" / name))
