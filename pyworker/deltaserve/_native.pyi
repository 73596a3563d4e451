"""Typed stub of ``deltaserve._native``, the private Rust extension (``router/crates/py``).

Conversion only: the ring, doorbells and schema live in the Rust ``ipc`` crate, the safetensors
reader in ``tensorfile``. Blocking calls
release the GIL and check for signals at least every 100 ms (Ctrl-C interrupts them).

Errors: problems with the link's files or shared state raise ``OSError`` (with ``errno`` where the
OS gave one, e.g. ``FileNotFoundError`` for a missing ring); bad arguments (a frame larger than
``max_frame_len``, an invalid capacity, a negative timeout) raise ``ValueError``; a bounded
``send`` whose ring stayed full raises ``TimeoutError``.
"""

import os
from typing import Final, Optional, Sequence

#: Ring capacity in bytes used when none is given (4 MiB; frames up to half of it).
DEFAULT_CAPACITY: Final[int]

def schema_hash() -> str:
    """The wire schema hash computed by Rust (16 lowercase hex digits); must equal ``wire.SCHEMA_HASH``."""

def schema_text() -> str:
    """The canonical schema text the hash is computed from; must equal ``wire.SCHEMA_TEXT``."""

class WorkerLink:
    """The worker's half of a router<->worker link in ``ipc_dir`` (created by the router).

    Receives ``StepPlan``/``Shutdown`` frames, sends ``Hello``/``StepOutput``/``WorkerError``
    frames (encode/decode them with ``deltaserve.wire``).
    """

    def __init__(self, ipc_dir: str, spin_us: int = 0) -> None:
        """Opens ``to_worker.ring``/``.bell`` (incoming) and ``from_worker.ring``/``.bell`` (outgoing).

        ``recv`` polls the ring for ``spin_us`` microseconds before sleeping on the doorbell.
        """

    def send(self, data: bytes, timeout_s: Optional[float] = None) -> None:
        """Sends one frame, waiting while the ring is full (``None``: as long as it takes).

        Raises ``ValueError`` if ``len(data) > max_frame_len`` (large bytes never travel on the
        ring) and ``TimeoutError`` if the ring stayed full for ``timeout_s`` seconds.
        """

    def recv(self, timeout_s: Optional[float] = None) -> Optional[bytes]:
        """The next frame, waiting at most ``timeout_s`` seconds (``None``: forever); ``None`` on timeout."""

    @property
    def ipc_dir(self) -> str:
        """The link directory this half was opened on."""

    @property
    def max_frame_len(self) -> int:
        """Largest frame ``send`` accepts: half the ring capacity minus the 4-byte length prefix."""

class RouterLink:
    """The router's half of a link, so Python tests and tools can play the router."""

    def __init__(self, ipc_dir: str, create: bool = True, capacity: int = ...) -> None:
        """Opens the router's half; with ``create`` first creates ``ipc_dir`` and its four files.

        ``capacity`` (bytes, a power of two, default ``DEFAULT_CAPACITY``) sizes each ring when
        creating. Creating replaces stale files of an earlier link in the same directory.
        """

    def send(self, data: bytes, timeout_s: Optional[float] = None) -> None:
        """Sends one frame to the worker; same contract as ``WorkerLink.send``."""

    def recv(self, timeout_s: Optional[float] = None) -> Optional[bytes]:
        """The next frame from the worker; same contract as ``WorkerLink.recv``."""

    @property
    def ipc_dir(self) -> str:
        """The link directory this half was opened on."""

    @property
    def max_frame_len(self) -> int:
        """Largest frame ``send`` accepts."""

def read_safetensors_into(
    path: str | os.PathLike[str],
    copies: Sequence[tuple[str, int, int, int, bool]],
    dst_dtype: str,
    dst_ptr: int = 0,
    dst_len: int = 0,
) -> None:
    """Copies 2-D tensors of a safetensors file into a host buffer, without the GIL.

    ``copies``: ``(name, rows, cols, dst_offset, transpose)``; each tensor must exist with shape
    ``[rows, cols]`` and dtype F16, BF16 or F32; it is written (converted to ``dst_dtype``, rounding
    to nearest even) at element ``dst_offset`` of the buffer, row-major or transposed. Values that
    are not finite, in the file or after the conversion, raise ``ValueError`` naming the tensor and
    the first bad element; so does a missing tensor, another shape or dtype, a malformed file or a
    copy outside the buffer (checked before anything is written). ``OSError`` when the file cannot
    be opened. ``dst_ptr``/``dst_len``: address and byte size of a contiguous CPU buffer the caller
    keeps alive and untouched during the call; ``dst_ptr`` 0 checks everything and writes nothing.
    """

def read_safetensors_header(path: str | os.PathLike[str]) -> dict[str, tuple[str, list[int]]]:
    """``{name: (dtype, shape)}`` of every tensor in a safetensors file (``__metadata__`` left out),
    reading only its header, without the GIL and without mapping the file. ``ValueError`` for a
    malformed header, ``OSError`` when the file cannot be read."""

