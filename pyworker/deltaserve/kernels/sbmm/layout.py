"""One linear's delta pool (``DeltaWeights``): every GPU-resident delta of that linear, slot by slot.

One pool per linear and per (bits, sparse, group size) config: every delta of that linear lives in
one of ``num_slots`` slots; each tensor kind of the packed format (``deltaserve.formats.packed_delta``)
has one flat buffer, and a slot's tensor is a row-major block at an element offset::

    qvalues  [*] int32     slot s: qvalues_offsets[s] .. + out * kept*bits/32     (rows of packed codes)
    qindices [*] int32     slot s: qindices_offsets[s] .. + out * kept/16         (2:4 only; else empty)
    scales   [*] float16   slot s: group_offsets[s] .. + out * in/G               (rows of groups)
    zeros    [*] float16   slot s: group_offsets[s] .. + out * in/G               (same offsets as scales)
    qvalues_offsets, qindices_offsets, group_offsets   [num_slots] int64

    e.g. 3 slots, slot 1 empty (make_delta_weights reserves a region for every slot):
    qvalues | slot 0 codes | slot 1 (zeros) | slot 2 codes |     offsets 0, R, 2R (R = out*kept*bits/32)

bits, sparse, group size and the linear's [out, in] are fixed per pool (the kernels specialise on
them); a model whose deltas mix configs holds one pool per config.

**Layout of a slot's words** (``DeltaWeights.layout``): ``"plain"``, the format's row-major blocks above,
or ``"repacked"``, the same words permuted at ``store`` into the order csrc/sbmm.cu's lanes consume them
(``repack.py``, which owns the permutation; same sizes, same offsets). ``packed(slot)`` gives the
format's tensors back either way (``repack.unpack``), which is what the reference and the Triton kernels
read (csrc/sbmm.cu's SBMM and dense dequantiser read the repacked words as they
are). The layout is picked at construction: ``layout="auto"`` (the default) reads ``DELTASERVE_SBMM_LAYOUT``
(``plain`` | ``repacked`` | ``auto``, default ``auto``); ``repacked`` repacks any pool whose shape fits
(``repack.fits``; CPU too: the tests) and keeps the others plain; ``plain`` keeps the format's layout;
``auto`` repacks a pool that fits where the CUDA op serves it (a CUDA pool whose slot blocks are aligned
as it reads them, ``cuda_alignment_problem``, csrc/sbmm.cu built), since its
decode SBMM reads the repacked words at up to 0.84 of the copy bandwidth against 0.49 plain (H100,
bench/README), and keeps the format's layout elsewhere (the CPU reference and the Triton kernels would
unpack a repacked slot at every call). Until the dense dequantiser read the repacked words (it unpacked each
linear first), auto stayed plain: a one-delta prefill step of ~400 tokens took 0.21 s against 0.06 s.
Slot ids are shared by all linears of a model; ``-1`` means "no delta" (base-only tokens, LoRA tokens).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from ...formats.packed_delta import PackedLinear, check_layout, dequantize
from .. import cuda_ext
from . import repack as fragments

LAYOUT_ENV = "DELTASERVE_SBMM_LAYOUT"
"""The environment variable that picks new pools' layout (module docstring): plain, repacked, auto."""
LAYOUTS = ("plain", "repacked")


@dataclass(frozen=True)
class DeltaWeights:
    """One linear's delta pool: flat buffers per tensor kind plus per-slot offsets (module docstring).

    Validated once at construction (one host sync for the offset tables). ``store`` / ``clear``
    refill a slot in place, so the buffers' addresses (and CUDA graphs that captured them) stay.
    """

    qvalues: torch.Tensor
    """1-D int32: every slot's packed codes, slot s's ``[out, kept*bits/32]`` block at qvalues_offsets[s]."""
    qindices: torch.Tensor
    """1-D int32: every slot's 2:4 position words ``[out, kept/16]`` at qindices_offsets[s]; empty when dense."""
    scales: torch.Tensor
    """1-D float16: every slot's ``[out, in/G]`` scales at group_offsets[s]."""
    zeros: torch.Tensor
    """1-D float16: every slot's ``[out, in/G]`` zero points at group_offsets[s]."""
    qvalues_offsets: torch.Tensor
    """[num_slots] int64: element offset of each slot's qvalues block."""
    qindices_offsets: torch.Tensor
    """[num_slots] int64: element offset of each slot's qindices block (unread when dense)."""
    group_offsets: torch.Tensor
    """[num_slots] int64: element offset of each slot's scales block and of its zeros block."""
    bits: int
    """Bits per code of every slot (2 or 4)."""
    sparse: bool
    """Whether every slot is 2:4-sparse along the input dimension."""
    group_size: int
    """Input columns per (scale, zero) of every slot."""
    out_features: int
    """Rows of the linear's weight (the op's output width)."""
    in_features: int
    """Columns of the linear's weight (the op's input width)."""
    loaded: list[bool] = field(default_factory=list)
    """Host flags, one per slot: the slot holds a delta (``store``d); left empty at construction, every
    slot counts as loaded. A step that uses an empty slot is refused (its zero-filled region would
    silently add nothing)."""
    half2_ok: torch.Tensor | None = field(default=None, repr=False, compare=False)
    """[num_slots] uint8 on the pool's device, one flag per slot: every zero point of the slot is an
    integer in (-1024, 1024), as the compressor writes them (set by ``store``; 0 where unknown, zeros at
    construction). The CUDA op reads it per block and takes its half2 dequantisation, exact only then
    (csrc/sbmm.cu RowScale), for float16 slots so flagged: no host check per call, no sync per ``store``,
    and a captured launch stays right whatever deltas come later."""
    offset_alignment: tuple[int, int, int] = field(default=(0, 0, 0), init=False, repr=False, compare=False)
    """(qvalues, qindices, scales / zeros): the largest power of two up to 4 (scales / zeros: 8) dividing
    every slot block's start address, in elements (buffer address plus slot offset; set by the offset
    check, the buffers never move); the CUDA op copies 16- and 4-byte pieces."""
    slot_offsets: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]] = field(
        default=((), (), ()), init=False, repr=False, compare=False
    )
    """Host copies of (qvalues, qindices, group) offsets, taken by the offset check (the tables, like the
    buffers, never change after it): ``store`` and ``packed`` find a slot without a device read (no sync
    per store: a delta's load enqueues its linears' copies back to back)."""
    layout: str = field(default="auto", compare=False)
    """How a slot's words are ordered: ``"plain"`` (the format's) or ``"repacked"`` (``repack.py``); ``"auto"``
    at construction picks one (module docstring) and the field then holds the pick."""
    ref_cache: dict[tuple[int, torch.dtype], torch.Tensor] | None = field(default=None, repr=False, compare=False)
    """(slot, dtype) -> ``dequantize`` of that slot for ``sbmm_ref``, when enabled (``cache_reference``:
    the CPU serving path, which would otherwise dequantise every delta at every call); None: off.
    ``store`` / ``clear`` drop the slot's entries; writing the buffers directly would not."""

    def __post_init__(self) -> None:
        n = self.qvalues_offsets.shape[0] if self.qvalues_offsets.dim() == 1 else -1
        if not self.loaded:
            self.loaded.extend([True] * max(n, 0))
        # The layout rules of the format (bits, group size, shape) are packed_delta.py's; check them there.
        check_layout(self.bits, self.sparse, self.group_size, self.out_features, self.in_features)
        bufs = {"qvalues": (self.qvalues, torch.int32), "qindices": (self.qindices, torch.int32),
                "scales": (self.scales, torch.float16), "zeros": (self.zeros, torch.float16)}  # fmt: skip
        for name, (t, dtype) in bufs.items():
            if t.dim() != 1 or t.dtype != dtype or (t.numel() and t.stride(0) != 1):
                raise ValueError(f"sbmm: pool {name} {list(t.shape)} {t.dtype}: want a 1-D contiguous {dtype} buffer")
        tables = {"qvalues_offsets": self.qvalues_offsets, "qindices_offsets": self.qindices_offsets,
                  "group_offsets": self.group_offsets}  # fmt: skip
        for name, t in tables.items():
            if t.dim() != 1 or t.shape[0] != n or n < 1 or t.dtype != torch.int64 or t.stride(0) != 1:
                raise ValueError(
                    f"sbmm: {name} {list(t.shape)} {t.dtype}: want [num_slots >= 1] int64, contiguous, "
                    f"like qvalues_offsets {list(self.qvalues_offsets.shape)}"
                )
        if len(self.loaded) != n:
            raise ValueError(f"sbmm: {len(self.loaded)} loaded flags for {n} slots")
        devices = {t.device for t in (*[b for b, _ in bufs.values()], *tables.values())}
        if len(devices) != 1:
            raise ValueError(
                f"sbmm: pool buffers and offset tables must be on one device, got {sorted(map(str, devices))}"
            )
        if self.half2_ok is None:
            object.__setattr__(self, "half2_ok", torch.zeros(max(n, 0), dtype=torch.uint8, device=self.qvalues.device))
        elif self.half2_ok.shape != (n,) or self.half2_ok.dtype != torch.uint8 or self.half2_ok.device not in devices:
            raise ValueError(
                f"sbmm: half2_ok {list(self.half2_ok.shape)} {self.half2_ok.dtype}: want [{n}] uint8 "
                "on the pool's device"
            )
        self._check_offsets()
        object.__setattr__(self, "layout", self._pick_layout())

    def _pick_layout(self) -> str:
        """The layout this pool takes (module docstring); raises when ``repacked`` is asked and cannot be."""
        want = self.layout
        if want == "auto":
            want = os.environ.get(LAYOUT_ENV, "auto").strip().lower() or "auto"
            if want not in (*LAYOUTS, "auto"):
                raise ValueError(f"sbmm: {LAYOUT_ENV}={want!r}: want plain, repacked or auto")
            if want == "auto":  # repacked where csrc/sbmm.cu reads it (module docstring)
                readable = self.qvalues.is_cuda and self.cuda_alignment_problem(repacked=True) is None
                on_cuda_op = readable and cuda_ext.library("sbmm") is not None
                return "repacked" if on_cuda_op and self._repack_problem() is None else "plain"
        if want not in LAYOUTS:
            raise ValueError(f"sbmm: pool layout {want!r}: want one of {LAYOUTS} or auto")
        if want == "repacked":
            why = self._repack_problem()
            if why is not None and self.layout == "repacked":
                raise ValueError(f"sbmm: this pool cannot take the repacked layout: {why}")
            return "plain" if why is not None else want
        return want

    def _repack_problem(self) -> str | None:
        return fragments.fits(self.bits, self.sparse, self.group_size, self.out_features, self.in_features)

    def cuda_alignment_problem(self, repacked: bool | None = None) -> str | None:
        """Why csrc/sbmm.cu cannot read this pool's slot blocks, or None: it copies qvalues and qindices in
        16-byte pieces, and scales / zeros in 4-byte pieces over the plain layout, 16-byte ones over the
        repacked one (whose dense dequantiser also loads them as 8-byte words). ``repacked``: judge for
        that layout (default: the pool's)."""
        repacked = self.repacked if repacked is None else repacked
        qv, qi, group = self.offset_alignment
        want_group = 8 if repacked else 2
        if qv < 4 or qi < 4 or group < want_group:
            return f"slot blocks aligned to {self.offset_alignment} elements (want 4, 4, {want_group})"
        return None

    @property
    def repacked(self) -> bool:
        """Whether the slots hold the repacked layout (``repack.py``) rather than the format's."""
        return self.layout == "repacked"

    @property
    def half2_flags(self) -> torch.Tensor:
        """``half2_ok`` as construction leaves it: never None (``__post_init__`` fills a None)."""
        assert self.half2_ok is not None
        return self.half2_ok

    def slot_shapes(self) -> tuple[tuple[int, int], tuple[int, int] | None, tuple[int, int]]:
        """Shapes of one slot's qvalues, qindices (None when dense) and scales / zeros blocks."""
        out, inf, b = self.out_features, self.in_features, self.bits
        kept = inf // 2 if self.sparse else inf
        qi = (out, kept // 16) if self.sparse else None
        return (out, kept * b // 32), qi, (out, inf // self.group_size)

    def _check_offsets(self) -> None:
        """Every slot's blocks lie inside their buffers (one host sync)."""
        qv, qi, g = self.slot_shapes()
        checks = [("qvalues", self.qvalues_offsets, qv, self.qvalues), ("scales", self.group_offsets, g, self.scales),
                  ("zeros", self.group_offsets, g, self.zeros)]  # fmt: skip
        if qi is not None:
            checks.append(("qindices", self.qindices_offsets, qi, self.qindices))
        align = {"qvalues": 4, "qindices": 4, "scales": 8, "zeros": 8}
        for name, offs, shape, buf in checks:
            size = shape[0] * shape[1]
            for slot, o in enumerate(offs.tolist()):
                if o < 0 or o + size > buf.numel():
                    raise ValueError(
                        f"sbmm: slot {slot}'s {name} block [{o}, {o + size}) is outside the "
                        f"{buf.numel()}-element {name} buffer"
                    )
                at = buf.data_ptr() // buf.element_size() + o
                while at % align[name]:
                    align[name] //= 2
        object.__setattr__(self, "offset_alignment", (align["qvalues"], align["qindices"], align["scales"]))
        tables = (self.qvalues_offsets, self.qindices_offsets, self.group_offsets)
        object.__setattr__(self, "slot_offsets", tuple(tuple(t.tolist()) for t in tables))

    @property
    def num_slots(self) -> int:
        return self.qvalues_offsets.shape[0]

    @property
    def device(self) -> torch.device:
        return self.qvalues.device

    def check_loaded(self, slot: int) -> None:
        """Raises unless slot ``slot`` holds a delta (host state only: no device read)."""
        if not 0 <= slot < self.num_slots or not self.loaded[slot]:
            raise ValueError(
                f"sbmm: delta slot {slot} holds no delta (the pool has {self.num_slots} slots, "
                f"loaded: {[s for s, ok in enumerate(self.loaded) if ok]})"
            )

    def packed(self, slot: int) -> PackedLinear:
        """Slot ``slot``'s delta as a ``PackedLinear`` in the format's layout (for ``dequantize``): views into
        the pool when it is plain, new tensors (``repack.unpack``) when it is repacked."""
        self.check_loaded(slot)
        return fragments.unpack(self._views(slot)) if self.repacked else self._views(slot)

    def plain_copy(self, slots: Iterable[int] | None = None) -> DeltaWeights:
        """This pool in the format's layout: what the Triton kernels read over a repacked pool (the pool
        itself when it is plain). A new pool holding only ``slots`` (default: every loaded one), unpacked,
        under the same slot ids; the others are empty. One host sync; not a fast path."""
        if not self.repacked:
            return self
        keep = sorted({s for s in (range(self.num_slots) if slots is None else slots) if self.loaded[s]})
        dev, n = self.device, self.num_slots
        qv, qi, g = (0 if shape is None else shape[0] * shape[1] for shape in self.slot_shapes())
        at = {s: i for i, s in enumerate(keep)}
        size = max(len(keep), 1)

        def offsets(elems: int) -> torch.Tensor:
            return torch.tensor([at.get(s, 0) * elems for s in range(n)], dtype=torch.int64, device=dev)

        w = DeltaWeights(
            qvalues=torch.zeros(size * qv, dtype=torch.int32, device=dev),
            qindices=torch.zeros(size * qi, dtype=torch.int32, device=dev),
            scales=torch.zeros(size * g, dtype=torch.float16, device=dev),
            zeros=torch.zeros(size * g, dtype=torch.float16, device=dev),
            qvalues_offsets=offsets(qv), qindices_offsets=offsets(qi), group_offsets=offsets(g),
            bits=self.bits, sparse=self.sparse, group_size=self.group_size, out_features=self.out_features,
            in_features=self.in_features, loaded=[s in at for s in range(n)], half2_ok=self.half2_flags.clone(),
            layout="plain",
        )  # fmt: skip
        for s in keep:
            fragments.unpack(self._views(s), out=w._views(s))
        return w

    def _views(self, slot: int) -> PackedLinear:
        """Slot ``slot``'s region as a ``PackedLinear`` of views, loaded or not."""
        qv, qi, g = self.slot_shapes()

        qv_at, qi_at, g_at = (offs[slot] for offs in self.slot_offsets)

        def view(buf: torch.Tensor, o: int, shape: tuple[int, int]) -> torch.Tensor:
            return buf[o : o + shape[0] * shape[1]].view(shape)

        return PackedLinear(self.bits, self.sparse, self.group_size, self.out_features, self.in_features,
                            view(self.qvalues, qv_at, qv), None if qi is None else view(self.qindices, qi_at, qi),
                            view(self.scales, g_at, g), view(self.zeros, g_at, g))  # fmt: skip

    def cache_reference(self) -> None:
        """Lets ``sbmm_ref`` keep each slot's dequantised delta (more memory, no repeated unpacking)."""
        if self.ref_cache is None:
            object.__setattr__(self, "ref_cache", {})

    def reference_delta(self, slot: int, dtype: torch.dtype) -> torch.Tensor:
        """``dequantize(packed(slot), dtype)`` as float32 ``[out, in]``: what ``sbmm_ref`` multiplies by."""
        key = (slot, dtype)
        if self.ref_cache is not None and key in self.ref_cache:
            return self.ref_cache[key]
        delta = dequantize(self.packed(slot), dtype).float()
        if self.ref_cache is not None:
            self.ref_cache[key] = delta
        return delta

    def _forget(self, slot: int) -> None:
        if self.ref_cache:
            for key in [k for k in self.ref_cache if k[0] == slot]:
                del self.ref_cache[key]

    def store(self, slot: int, p: PackedLinear) -> None:
        """Copies ``p`` into slot ``slot`` (in place) and marks it loaded."""
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"sbmm: delta slot {slot} out of range (the pool has {self.num_slots} slots)")
        _check_same_config(f"slot {slot}", p, self)
        dst = self._views(slot)
        if self.repacked:  # straight into the slot: no copy of the repacked words, temporaries bounded
            fragments.repack(p if p.qvalues.device == self.device else p.to(self.device), out=dst)
        else:
            for name, t in p.tensors().items():
                getattr(dst, name).copy_(t)
        self._forget(slot)
        self.loaded[slot] = True
        z = dst.zeros
        self.half2_flags[slot] = ((z == z.round()) & (z.abs() < 1024)).all()  # on the device: no sync

    def clear(self, slot: int) -> None:
        """Marks slot ``slot`` empty; a step that uses it is refused until the next ``store``."""
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"sbmm: delta slot {slot} out of range (the pool has {self.num_slots} slots)")
        self._forget(slot)
        self.loaded[slot] = False


def _check_same_config(what: str, p: PackedLinear, ref: PackedLinear | DeltaWeights) -> None:
    for name in ("bits", "sparse", "group_size", "out_features", "in_features"):
        if getattr(p, name) != getattr(ref, name):
            raise ValueError(
                f"sbmm: {what} has {name} = {getattr(p, name)}, the pool has {getattr(ref, name)} "
                "(one pool holds one linear's deltas of one bits / sparsity / group-size config)"
            )


def make_delta_weights(
    packed: Sequence[PackedLinear | None], device: torch.device | str | None = None, *, layout: str = "auto"
) -> DeltaWeights:
    """A pool with one slot per entry (None: an empty slot, its region reserved and zero-filled), in
    ``layout`` (``DeltaWeights.layout``: auto, plain or repacked).

    Every delta must share bits, sparsity, group size and shape; the pool goes to ``device`` (default:
    the first delta's). Slot s's blocks sit at s times the slot size in each buffer.
    """
    if not packed:
        raise ValueError("sbmm: make_delta_weights needs at least one slot")
    present = [(s, p) for s, p in enumerate(packed) if p is not None]
    if not present:
        raise ValueError("sbmm: make_delta_weights needs at least one delta (all slots are None)")
    first = present[0][1]
    for s, p in present[1:]:
        _check_same_config(f"slot {s}", p, first)
    dev = torch.device(device) if device is not None else first.qvalues.device
    n = len(packed)
    sizes = {name: t.numel() for name, t in first.tensors().items()}
    qi_size = sizes.get("qindices", 0)
    w = DeltaWeights(
        qvalues=torch.zeros(n * sizes["qvalues"], dtype=torch.int32, device=dev),
        qindices=torch.zeros(n * qi_size, dtype=torch.int32, device=dev),
        scales=torch.zeros(n * sizes["scales"], dtype=torch.float16, device=dev),
        zeros=torch.zeros(n * sizes["zeros"], dtype=torch.float16, device=dev),
        qvalues_offsets=torch.arange(n, dtype=torch.int64, device=dev) * sizes["qvalues"],
        qindices_offsets=torch.arange(n, dtype=torch.int64, device=dev) * qi_size,
        group_offsets=torch.arange(n, dtype=torch.int64, device=dev) * sizes["scales"],
        bits=first.bits, sparse=first.sparse, group_size=first.group_size,
        out_features=first.out_features, in_features=first.in_features, loaded=[False] * n, layout=layout,
    )  # fmt: skip
    for s, p in present:
        w.store(s, p)
    return w
