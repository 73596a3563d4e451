"""Shared memory between the worker and its CPU LoRA helpers: anonymous ``memfd`` segments.

A segment is a ``memfd_create`` file mapped with ``mmap``; a helper gets the file descriptor
(``subprocess.Popen(pass_fds=...)``) and maps it too. Why memfd and not ``/dev/shm`` names
(``multiprocessing.shared_memory``): nothing is left behind when a process dies (the memory goes
away with its last descriptor and mapping), and its size is not capped by the container's
``/dev/shm`` (64 MiB by default under Docker). Pages are committed only when first written, so a
segment sized for the worst step costs what steps touch.

Three kinds per worker, all created by the worker::

    arena    the host tier's copies (``adapters/pinned_arena.PinnedArena`` over ``SharedSegment.tensor()``;
             registered with CUDA on GPU machines); helpers map it READ-ONLY
    control  int64 words: one ``protocol.JOB_WORDS`` row per helper (``protocol.py`` draws it)
    data     the LoRA input rows ``x`` and the helpers' results (``protocol.DataLayout``)
"""

from __future__ import annotations

import mmap
import os
import warnings
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # the helpers never import torch (they start faster); the worker has it loaded
    import torch


class SharedSegment:
    """``size`` bytes of shared memory the worker creates; ``fd`` is what a helper maps."""

    def __init__(self, size: int, name: str) -> None:
        if size <= 0:
            raise ValueError(f"SharedSegment {name}: size must be positive, got {size}")
        self.size = size
        self.name = name
        self.fd = os.memfd_create(f"deltaserve-{name}")  # close-on-exec: helpers get it by pass_fds
        os.ftruncate(self.fd, size)
        self.map = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)

    def tensor(self) -> torch.Tensor:
        """A uint8 tensor over the whole segment (the same memory, no copy)."""
        import torch

        return torch.frombuffer(self.map, dtype=torch.uint8)

    def array(self, dtype: np.dtype | type, count: int = -1, offset: int = 0) -> np.ndarray:
        """A numpy view of the segment."""
        return np.frombuffer(self.map, dtype=dtype, count=count, offset=offset)

    def close(self) -> None:
        """Drops the worker's descriptor; the mapping stays while views of it live."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def attach(fd: int, size: int, *, writable: bool) -> mmap.mmap:
    """A helper's mapping of a segment the worker passed it (read-only unless ``writable``)."""
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    return mmap.mmap(fd, size, mmap.MAP_SHARED, prot)


def readonly_array(mapping: mmap.mmap, dtype: np.dtype | type, count: int, offset: int) -> np.ndarray:
    """A numpy view of a read-only mapping (writes to it fault, by the mapping's protection)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return np.frombuffer(mapping, dtype=dtype, count=count, offset=offset)


__all__ = ["SharedSegment", "attach", "readonly_array"]
