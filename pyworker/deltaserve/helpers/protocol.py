"""What the worker and its CPU LoRA helpers exchange: pipe frames, control words, data layout.

Bulk data never goes through the pipes: ``x`` rows and results sit in the data segment, the job in
the control segment; a pipe carries one byte to wake the other side (a doorbell) or a small JSON
message (an adapter's place in the arena, the step's row segments). No pickle anywhere.

Pipes (one pair per helper)::

    worker -> helper   b"J"                  a job is in my control row: run it
                       b"R" len:u32 JSON     register an adapter (``AdapterEntry.to_json``)
                       b"S" len:u32 JSON     the step's segments: [[adapter_id, lo, hi], ...] over the
                                             compacted rows of the data segment; forgets other adapters
                       b"j" 7 x int64        a signalled job (the sync-free path, ``signalled.py``):
                                             SEQ LAYER MODULE LO HI ROWS DTYPE; run it once the SEQ
                                             word reaches SEQ (the device wrote x's rows before it)
                       b"Q"                  exit (EOF on this pipe means the same: the worker is gone)
    helper -> worker   b"H" len:u32 JSON     hello, once, after its profile: {pid, core, macs_per_ms}
                       b"d"                  my control row's job is done (``DONE`` = its ``SEQ``)

Control segment: ``JOB_WORDS`` int64 per helper, row h is helper h's::

    SEQ     job sequence number, written by the worker last (after the other words)
    DONE    written by the helper after its results: == SEQ means the job's rows are in ``out``
    LAYER   decoder layer of the job
    MODULE  index into ``ModelSpec.modules`` (qkv, o, gate_up, down)
    LO, HI  the helper's rows [LO, HI) of the compacted rows (its slice of the step's assisted rows)
    ROWS    compacted rows in ``x`` this job (the views' first dimension)
    DTYPE   ``DTYPE_CODES`` of ``x`` and of the adapters' weights
    STATUS  0 ok, 1 the helper failed this job (the worker computes it itself)
    FAILED  a signalled job (``j``) that failed: its SEQ, DONE left as it was (the worker's watcher
            computes the rows and writes DONE; a DONE from a failed helper would release the
            device's wait onto rows nobody wrote)

Sequence numbers are per pool, one per (step, layer, module) job, increasing for the pool's life
(a restarted helper keeps its row's last SEQ and DONE: no stale word can equal a new number). The
sync-free variant (``j``) keeps the same words: the job's description travels in the frame (pipe
order is step order, so the worker may describe jobs a step ahead of the device), SEQ is written
by the device after it copied ``x`` (``csrc/cpu_lora_signal.cu``), and the device waits on DONE.

Data segment: ``x`` as ``[ROWS, in_dim]`` in the model dtype from offset 0; results as
``[ROWS, out_width]`` float32 from ``DataLayout.out_offset`` (``scale * (x A^T) B^T`` per adapted
slice of the module, 0 in the columns of slices the adapter does not adapt).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from typing import Any

JOB_WORDS = 16
"""int64 words per helper in the control segment (10 used; room to append)."""
SEQ, DONE, LAYER, MODULE, LO, HI, ROWS, DTYPE, STATUS, FAILED = range(10)
SIGNALLED_JOB = struct.Struct("<7q")
"""The ``j`` frame's payload: seq, layer, module, lo, hi, rows, dtype."""

DTYPE_CODES = {"float32": 0, "float16": 1, "bfloat16": 2}
"""Element types of ``x`` and of the adapters' host copies, as control words."""
DTYPE_BYTES = {0: 4, 1: 2, 2: 2}


@dataclass(frozen=True)
class ModelSpec:
    """The model's adapted modules as the helpers see them (given once, at start)."""

    modules: tuple[tuple[int, tuple[tuple[int, int, int], ...]], ...]
    """Per module (qkv, o, gate_up, down): (in_dim, ((slice index, first column, columns), ...))."""
    hidden_size: int
    """The model's hidden size (the profile's matmul width)."""

    def to_json(self) -> str:
        return json.dumps({"modules": self.modules, "hidden_size": self.hidden_size})

    @classmethod
    def from_json(cls, text: str) -> ModelSpec:
        d = json.loads(text)
        modules = tuple((int(i), tuple((int(s), int(c), int(n)) for s, c, n in sl)) for i, sl in d["modules"])
        return cls(modules, int(d["hidden_size"]))


@dataclass(frozen=True)
class DataLayout:
    """Where ``x`` and the results sit in the data segment."""

    max_rows: int
    """Most compacted rows one step sends (``max_num_batched_tokens``)."""
    max_in: int
    """Widest module input."""
    max_out: int
    """Widest module output."""

    @property
    def out_offset(self) -> int:
        """Bytes of the ``x`` region (sized for float32), 4 KiB-aligned."""
        return -(-self.max_rows * self.max_in * 4 // 4096) * 4096

    @property
    def size(self) -> int:
        return self.out_offset + self.max_rows * self.max_out * 4


@dataclass(frozen=True)
class AdapterEntry:
    """One adapter's host copy as a helper reads it: a ``[layers, packed_elems]`` array at ``offset``
    bytes into the arena (``adapters/lora_layout.py`` draws the packed rows)."""

    adapter_id: int
    offset: int
    """Byte offset of the host copy in the arena."""
    dtype: int
    """``DTYPE_CODES`` of its elements."""
    layers: int
    packed_elems: int
    slices: dict[int, tuple[int, int, int, int]]
    """Slice index -> (packed_start, rows placed r_p, in_dim, out_dim)."""
    rank: list[list[int]]
    """[layers][n_slices]: rows read per layer and slice (0 = not adapted there)."""
    scale: list[list[float]]
    """[layers][n_slices]: the LoRA scaling."""

    def to_json(self) -> str:
        return json.dumps(
            {
                "id": self.adapter_id,
                "offset": self.offset,
                "dtype": self.dtype,
                "layers": self.layers,
                "packed_elems": self.packed_elems,
                "slices": [[k, *v] for k, v in self.slices.items()],
                "rank": self.rank,
                "scale": self.scale,
            }
        )

    @classmethod
    def from_json(cls, text: str) -> AdapterEntry:
        d = json.loads(text)
        return cls(
            int(d["id"]),
            int(d["offset"]),
            int(d["dtype"]),
            int(d["layers"]),
            int(d["packed_elems"]),
            {int(s[0]): (int(s[1]), int(s[2]), int(s[3]), int(s[4])) for s in d["slices"]},
            [[int(r) for r in row] for row in d["rank"]],
            [[float(s) for s in row] for row in d["scale"]],
        )


def frame(kind: bytes, payload: str | None = None) -> bytes:
    """One pipe frame: the kind byte, then (for R, S, H) a length-prefixed UTF-8 JSON payload."""
    if payload is None:
        return kind
    data = payload.encode()
    return kind + struct.pack("<I", len(data)) + data


def signalled_job_frame(seq: int, layer: int, module: int, lo: int, hi: int, rows: int, dtype: int) -> bytes:
    """A ``j`` frame: a job whose rows the device signals with the SEQ word."""
    return b"j" + SIGNALLED_JOB.pack(seq, layer, module, lo, hi, rows, dtype)


def read_exact(fd: int, n: int) -> bytes:
    """``n`` bytes from ``fd`` (blocking); b"" at EOF."""
    chunks = []
    while n:
        chunk = os.read(fd, n)
        if not chunk:
            return b""
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def read_payload(fd: int) -> str | None:
    """The JSON payload after a kind byte that has one; None at EOF."""
    head = read_exact(fd, 4)
    if not head:
        return None
    (n,) = struct.unpack("<I", head)
    data = read_exact(fd, n)
    return data.decode() if len(data) == n else None


def hello_payload(pid: int, core: int, macs_per_ms: float) -> str:
    return json.dumps({"pid": pid, "core": core, "macs_per_ms": macs_per_ms})


def parse_hello(text: str) -> dict[str, Any]:
    d = json.loads(text)
    return {"pid": int(d["pid"]), "core": int(d["core"]), "macs_per_ms": float(d["macs_per_ms"])}


__all__ = [
    "AdapterEntry",
    "DTYPE",
    "DTYPE_BYTES",
    "DTYPE_CODES",
    "DONE",
    "DataLayout",
    "FAILED",
    "HI",
    "JOB_WORDS",
    "LAYER",
    "LO",
    "MODULE",
    "ModelSpec",
    "ROWS",
    "SEQ",
    "SIGNALLED_JOB",
    "STATUS",
    "frame",
    "hello_payload",
    "parse_hello",
    "read_exact",
    "read_payload",
    "signalled_job_frame",
]
