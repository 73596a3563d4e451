"""The repacked SBMM layout (``kernels/sbmm/repack.py``) equals the reference dequantisation for every config.

- ``unpack(repack(p)) == p`` word for word, for 2 / 4 bits, dense / 2:4, groups 32 / 64 / 128;
- every field of the repacked words is the code the MMA fragment of its lane wants (the layout as the
  module docstring draws it, computed here independently of repack.py's reshapes), and the 2:4
  metadata / scale words are the halves the docstring names;
- a repacked pool: ``packed`` gives the format back, ``sbmm_ref``, the Triton kernels (interpreter on
  CPU) and ``dequantize_slot`` over it equal the reference from the original ``PackedLinear``s; the
  layout is picked as ``DELTASERVE_SBMM_LAYOUT`` says;
- on CUDA (``DELTASERVE_TEST_GPU=1``): the dense dequantiser over a repacked pool equals ``dequantize``
  bit for bit; csrc/sbmm.cu over a repacked pool equals the reference for every config, float16 (half2
  and fp32 dequantisation) and bfloat16, bit for bit the op over the plain layout, split K, fused
  slices, and in a CUDA graph.
"""

from __future__ import annotations

import dataclasses
import os
import zlib

import pytest
import torch

from deltaserve.formats.packed_delta import PackedLinear, dequantize, pack
from deltaserve.kernels import sbmm as sbmm_mod
from deltaserve.kernels.sbmm import DeltaMeta, dequantize_slot, make_delta_weights, sbmm_ref, sbmm_triton
from deltaserve.kernels.sbmm.repack import fits, repack, unpack
from kernels.test_sbmm import retarget

pytestmark = pytest.mark.gpu_sbmm

DEVICE = torch.device("cuda" if os.environ.get("DELTASERVE_TEST_GPU") == "1" else "cpu")
CONFIGS = [(2, False), (2, True), (4, False), (4, True)]
CONFIG_IDS = ["2b", "2b-2:4", "4b", "4b-2:4"]
RTOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-5}


def random_packed(out_f: int, in_f: int, bits: int, sparse: bool, group: int, seed: int, integral: bool = True):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (out_f, in_f), generator=g)
    mask = None
    if sparse:
        keep = torch.rand(out_f, in_f // 4, 4, generator=g).argsort(-1)[..., :2]
        mask = torch.zeros(out_f, in_f // 4, 4, dtype=torch.bool).scatter_(-1, keep, True).reshape(out_f, in_f)
    scales = torch.rand(out_f, in_f // group, generator=g) * 0.05 + 0.005
    zeros = torch.rand(out_f, in_f // group, generator=g) * (2**bits - 1)
    return pack(codes, mask, scales, zeros.round() if integral else zeros, bits, group).to(DEVICE)


def plain_codes(p: PackedLinear) -> torch.Tensor:
    """[out, kept] codes of the format (kept value i at bits (i % per) * bits of word i // per)."""
    shifts = torch.arange(0, 32, p.bits, device=p.qvalues.device)
    return ((p.qvalues.to(torch.int64).unsqueeze(-1) >> shifts) & ((1 << p.bits) - 1)).reshape(p.out_features, -1)


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_unpack_inverts_repack(config: tuple[int, bool], group: int) -> None:
    bits, sparse = config
    p = random_packed(128, 512, bits, sparse, group, seed=zlib.crc32(f"{config}{group}".encode()))
    r = repack(p)
    for name, t in p.tensors().items():
        assert r.tensors()[name].shape == t.shape and r.tensors()[name].dtype == t.dtype
        assert torch.equal(unpack(r).tensors()[name], t), name
    assert not torch.equal(r.qvalues, p.qvalues)


@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_fields_are_the_lanes_fragments(config: tuple[int, bool]) -> None:
    """Word (rb, stage, warp, kp, mt, g, t), field (h, ko, j) of the repacked qvalues holds the code of
    row 128 rb + 32 warp + 16 mt + g + 8 (j & 1), 2:4 kept value 2 (chunk) + h with chunk = 8 ks + t +
    4 (j >> 1), or dense column 16 ks + 2t + 8 (j >> 1) + h (ks the stage's k-step 2 kp + ko, 2-bit)."""
    bits, sparse = config
    out_f, in_f, group = 256, 512, 64
    p = random_packed(out_f, in_f, bits, sparse, group, seed=7).to("cpu")
    r = repack(p)
    codes = plain_codes(p)
    ko_n = 2 if bits == 2 else 1
    steps = 256 // (32 if sparse else 16)
    rb, st, warp, kp, mt, g, t, h, ko, jhi, jrow = torch.meshgrid(
        *(torch.arange(n) for n in (out_f // 128, in_f // 256, 4, steps // ko_n, 2, 8, 4, 2, ko_n, 2, 2)),
        indexing="ij",
    )
    row = rb * 128 + warp * 32 + mt * 16 + g + 8 * jrow
    ks = st * steps + kp * ko_n + ko
    kept = (ks * 8 + t + 4 * jhi) * 2 + h if sparse else ks * 16 + 2 * t + 8 * jhi + h
    fields = (r.qvalues.reshape(-1).to(torch.int64) & 0xFFFFFFFF).reshape(-1, 1) >> (
        torch.arange(0, 32, bits).reshape(1, -1)
    )
    want = codes[row, kept].reshape(-1, 32 // bits)
    assert torch.equal(fields & ((1 << bits) - 1), want)
    # scales: (rb, stage, warp, gi, g, mt, jrow) halves
    gs = 256 // group
    rb, st, warp, gi, g, mt, jrow = torch.meshgrid(
        *(torch.arange(n) for n in (out_f // 128, in_f // 256, 4, gs, 8, 2, 2)), indexing="ij"
    )
    srow, scol = rb * 128 + warp * 32 + mt * 16 + g + 8 * jrow, st * gs + gi
    assert torch.equal(r.scales.reshape(-1), p.scales[srow, scol].reshape(-1))
    assert torch.equal(r.zeros.reshape(-1), p.zeros[srow, scol].reshape(-1))
    if sparse:  # (rb, stage, warp, ks, mt, g, t01) words: half t01 of rows g (low half) and g + 8 (high)
        halves = p.qindices.contiguous().view(torch.int16).reshape(out_f, -1, 2)
        rb, st, warp, k8, mt, g, t01, jrow = torch.meshgrid(
            *(torch.arange(n) for n in (out_f // 128, in_f // 256, 4, 8, 2, 8, 2, 2)), indexing="ij"
        )
        want_i = halves[rb * 128 + warp * 32 + mt * 16 + g + 8 * jrow, st * 8 + k8, t01]
        assert torch.equal(r.qindices.contiguous().view(torch.int16).reshape(-1), want_i.reshape(-1))


def test_fits_and_bad_shapes() -> None:
    assert fits(4, True, 64, 4096, 11008 - 11008 % 256) is None
    assert "out % 128" in (fits(4, True, 64, 200, 256) or "")
    assert fits(4, True, 96, 128, 768) is not None
    with pytest.raises(ValueError, match="repacked layout wants"):
        repack(random_packed(64, 256, 4, True, 64, seed=1))


def test_layout_is_picked_by_env(monkeypatch: pytest.MonkeyPatch) -> None:
    p = random_packed(128, 256, 4, True, 64, seed=3)
    monkeypatch.delenv("DELTASERVE_SBMM_LAYOUT", raising=False)
    on_cuda_op = DEVICE.type == "cuda" and sbmm_mod.cuda_ext.library("sbmm") is not None
    want = "repacked" if on_cuda_op else "plain"
    assert make_delta_weights([p]).layout == want, "auto: repacked where the CUDA op reads it (layout.py)"
    monkeypatch.setenv("DELTASERVE_SBMM_LAYOUT", "plain")
    assert make_delta_weights([p]).layout == "plain"
    monkeypatch.setenv("DELTASERVE_SBMM_LAYOUT", "repacked")
    assert make_delta_weights([p]).layout == "repacked"
    small = random_packed(64, 256, 4, True, 64, seed=4)
    assert make_delta_weights([small]).layout == "plain"  # does not fit: the format's layout
    with pytest.raises(ValueError, match="cannot take the repacked layout"):
        make_delta_weights([small], layout="repacked")
    monkeypatch.setenv("DELTASERVE_SBMM_LAYOUT", "tiled")
    with pytest.raises(ValueError, match="want plain, repacked or auto"):
        make_delta_weights([p])


def test_cuda_alignment_is_judged_per_layout() -> None:
    """``cuda_alignment_problem``: scales / zeros aligned to 2 elements suit the CUDA op over the plain
    layout (4-byte pieces) but not over the repacked one (16-byte pieces, 8-byte dequantiser loads), so
    ``auto`` keeps such a pool plain and the op refuses it repacked."""
    w = make_delta_weights([random_packed(128, 256, 4, True, 64, seed=5)], layout="plain")
    assert w.cuda_alignment_problem(repacked=False) is None and w.cuda_alignment_problem(repacked=True) is None

    def shifted(t: torch.Tensor) -> torch.Tensor:  # the same values, 4 bytes past an aligned allocation
        return torch.cat([t.new_zeros(2), t])[2:]

    odd = dataclasses.replace(w, scales=shifted(w.scales), zeros=shifted(w.zeros), layout="plain")
    assert odd.offset_alignment[2] == 2
    assert odd.cuda_alignment_problem(repacked=False) is None
    assert "want 4, 4, 8" in (odd.cuda_alignment_problem(repacked=True) or "")
    assert dataclasses.replace(w, scales=shifted(w.scales), zeros=shifted(w.zeros), layout="auto").layout == "plain"


@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_repacked_pool_reference_and_triton(config: tuple[int, bool]) -> None:
    """Over a repacked pool the reference, the Triton kernels and ``dequantize_slot`` read the format's
    values: they equal ``x @ dequantize(p).T`` from the original deltas (one empty slot)."""
    bits, sparse = config
    ps = [random_packed(128, 256, bits, sparse, 64, seed=s, integral=s != 1) for s in range(3)]
    w = make_delta_weights([ps[0], None, ps[1], ps[2]], layout="repacked")
    assert w.repacked and not torch.equal(w.qvalues[: ps[0].qvalues.numel()], ps[0].qvalues.reshape(-1))
    for s, p in ((0, ps[0]), (2, ps[1]), (3, ps[2])):
        for name, t in p.tensors().items():
            assert torch.equal(getattr(w.packed(s), name), t)
    assert w.half2_flags.tolist() == [1, 0, 0, 1]
    dtype = torch.float16 if DEVICE.type == "cuda" else torch.float32
    assert torch.equal(dequantize_slot(w, 2, dtype), dequantize(ps[1], dtype))
    slots = [3, 0, -1, 2, 2]
    meta = DeltaMeta.rows(slots, DEVICE)
    x = torch.randn(len(slots), 256, generator=torch.Generator().manual_seed(1)).to(dtype).to(DEVICE)
    base = torch.randn(len(slots), 128, generator=torch.Generator().manual_seed(2)).to(dtype).to(DEVICE)
    want = base.clone()
    for i, s in enumerate(slots):
        if s >= 0:
            d = dequantize({0: ps[0], 2: ps[1], 3: ps[2]}[s], dtype).float()
            want[i] = (base[i].float() + x[i].float() @ d.T).to(dtype)
    paths = [sbmm_ref] + ([sbmm_triton] if bits == 4 else [])  # Triton's configs: test_sbmm.py (interpreter: slow)
    for path in paths:
        torch.testing.assert_close(path(x, base.clone(), w, meta), want, rtol=RTOL[dtype], atol=RTOL[dtype])


# ---- CUDA: csrc/sbmm.cu over the repacked layout ----


def cuda_or_skip() -> None:
    if DEVICE.type != "cuda":
        pytest.skip("the CUDA op runs on CUDA only (DELTASERVE_TEST_GPU=1)")
    if sbmm_mod.cuda_ext.library("sbmm") is None:
        pytest.fail(f"csrc/sbmm.cu did not build: {sbmm_mod.cuda_ext.unavailable('sbmm')}")


def pools(bits: int, sparse: bool, out_f: int, in_f: int, group: int, integral: bool, n: int = 4):
    ps = [random_packed(out_f, in_f, bits, sparse, group, seed=zlib.crc32(f"{bits}{sparse}{group}{s}".encode()),
                        integral=integral) for s in range(n)]  # fmt: skip
    plain = make_delta_weights(ps, layout="plain")
    frag = make_delta_weights(ps, layout="repacked")
    assert not plain.repacked and frag.repacked
    return plain, frag


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_cuda_dequant_over_repacked_equals_dequantize(config, group: int, dtype: torch.dtype) -> None:
    """Every config: csrc/sbmm_dequant.cuh over the repacked words (every element written, NaN-filled ``out``)
    = ``dequantize`` of the format's tensors bit for bit, and the Triton path (which unpacks the slot)."""
    cuda_or_skip()
    bits, sparse = config
    plain, frag = pools(bits, sparse, 256, 512, group, integral=False)
    for s in range(4):
        want = dequantize(plain.packed(s), dtype)
        got = torch.full_like(want, float("nan"))
        assert dequantize_slot(frag, s, dtype, out=got) is got and torch.equal(got, want), s
        assert torch.equal(dequantize_slot(frag, s, dtype, use_triton=True), want), s


@pytest.mark.parametrize("zeros", ["fractional", "integral"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_cuda_op_over_repacked_equals_reference(config, group: int, dtype: torch.dtype, zeros: str) -> None:
    """Every config: the op over the repacked layout = ``sbmm_ref`` and, bit for bit, the op over the plain
    layout (same arithmetic, same order); decode rows and short segments, tiles of 8 and 16 tokens."""
    cuda_or_skip()
    bits, sparse = config
    plain, frag = pools(bits, sparse, 256, 512, group, zeros == "integral")
    gen = torch.Generator().manual_seed(zlib.crc32(f"{config}{group}{dtype}{zeros}".encode()))
    for meta in (DeltaMeta.rows([0, 1, -1, 2, 3, 3, 0, 2, 1, 1], DEVICE),  # one 8-token fragment
                 DeltaMeta.segments([3, 16, 1, 5], [2, 0, -1, 3], DEVICE),  # two
                 DeltaMeta.rows([2] * 20 + [-1, 0, 0], DEVICE, max_block_m=16)):  # fmt: skip
        x = torch.randn(meta.num_tokens, 512, generator=gen).to(dtype).to(DEVICE)
        base = torch.randn(meta.num_tokens, 256, generator=gen).to(dtype).to(DEVICE)
        want = sbmm_ref(x, base.clone(), plain, meta)
        got = sbmm_mod.sbmm_cuda(x, base.clone(), frag, meta)
        torch.testing.assert_close(got, want, rtol=RTOL[dtype], atol=RTOL[dtype])
        assert torch.equal(got, sbmm_mod.sbmm_cuda(x, base.clone(), plain, meta))


@pytest.mark.parametrize("split", [None, 3])
def test_cuda_op_over_repacked_split_k_and_stacked(split: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Split K (the split rule's and an uneven 3), and three repacked slices in one launch (a fused qkv)."""
    cuda_or_skip()
    from deltaserve.kernels.sbmm import cuda as cuda_mod

    if split is not None:
        monkeypatch.setattr(cuda_mod, "_cuda_split", lambda *a: split)
    slices = [pools(4, True, out_f, 1024, 64, True, n=3) for out_f in (256, 128, 128)]
    meta = DeltaMeta.rows([1, 2, -1, 0], DEVICE)
    x = torch.randn(4, 1024, generator=torch.Generator().manual_seed(3)).half().to(DEVICE)
    out = torch.zeros(4, 512, dtype=torch.float16, device=DEVICE)
    cols = [0, 256, 384]
    want = sbmm_mod.sbmm_stacked_cuda(x, out.clone(), [(p, c) for (p, _), c in zip(slices, cols)], meta)
    got = sbmm_mod.sbmm_stacked_cuda(x, out.clone(), [(f, c) for (_, f), c in zip(slices, cols)], meta)
    assert torch.equal(got, want)
    for (plain, _), c in zip(slices, cols):
        ref = sbmm_ref(x, out[:, c : c + plain.out_features].clone(), plain, meta)
        torch.testing.assert_close(got[:, c : c + plain.out_features], ref, rtol=2e-3, atol=2e-3)
    with pytest.raises(ValueError, match="share a layout"):
        sbmm_mod.sbmm_stacked_cuda(x, out.clone(), [(slices[0][0], 0), (slices[1][1], 256)], meta)


def test_cuda_op_over_repacked_in_a_cuda_graph() -> None:
    """Captured once, replayed with new slots and inputs: the reference, as the eager op."""
    cuda_or_skip()
    plain, frag = pools(4, True, 256, 1024, 64, True)
    x = torch.zeros(8, 1024, dtype=torch.float16, device=DEVICE)
    out = torch.zeros(8, 256, dtype=torch.float16, device=DEVICE)
    meta = DeltaMeta.rows([0, 0, 1, -1, 2, 3, 3, 3], DEVICE)
    sbmm_mod.sbmm_cuda(x, out, frag, meta)  # the split counters exist before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sbmm_mod.sbmm_cuda(x, out, frag, meta)
    for seed, slots in ((5, [3, 3, 3, 3, 1, 1, 0, 2]), (6, [0, 0, 1, 0, 3, 2, 2, 0])):
        new = DeltaMeta.rows(slots, DEVICE)
        assert new.block_m == meta.block_m
        retarget(meta, new)
        x.copy_(torch.randn(8, 1024, generator=torch.Generator().manual_seed(seed)).half())
        out.zero_()
        graph.replay()
        torch.testing.assert_close(out, sbmm_ref(x, torch.zeros_like(out), plain, new), rtol=2e-3, atol=2e-3)
        assert torch.equal(out, sbmm_mod.sbmm_cuda(x, torch.zeros_like(out), frag, new))


# ---- the repack at store: one row range or several, straight into the slot ----


@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_repack_by_row_ranges_and_into_a_slot(config: tuple[int, bool], monkeypatch: pytest.MonkeyPatch) -> None:
    """``repack`` a row block at a time (no temporaries budget) and ``store`` straight into a slot of a
    repacked pool give the words of one whole-linear ``repack`` (which the lane-field check above pins
    down); ``unpack`` a row block at a time inverts them; a non-contiguous ``out`` is refused."""
    from deltaserve.kernels.sbmm import repack as repack_mod

    bits, sparse = config
    p = random_packed(384, 512, bits, sparse, 64, seed=11).to("cpu")
    whole = repack(p)
    slot = make_delta_weights([None, p], "cpu", layout="repacked")._views(1)
    monkeypatch.setattr(repack_mod, "TEMP_BUDGET", 0)
    by_blocks = repack(p)
    back = unpack(by_blocks)
    for name, t in whole.tensors().items():
        assert torch.equal(by_blocks.tensors()[name], t), name
        assert torch.equal(slot.tensors()[name], t), name
        assert torch.equal(back.tensors()[name], p.tensors()[name]), name
    strided = PackedLinear(p.bits, p.sparse, p.group_size, p.out_features, p.in_features,
                           p.qvalues.t().contiguous().t(), p.qindices, p.scales.clone(), p.zeros.clone())  # fmt: skip
    with pytest.raises(ValueError, match="out's qvalues must be a contiguous"):
        repack(p, out=strided)


def test_store_on_cuda_equals_cpu_repack_with_bounded_temporaries() -> None:
    """On CUDA, ``store`` into a repacked pool writes the CPU ``repack``'s words, and the caching allocator
    sees at most ``TEMP_BUDGET`` times the linear's bytes of temporaries (a GPU full of KV)."""
    if DEVICE.type != "cuda":
        pytest.skip("CUDA only (DELTASERVE_TEST_GPU=1)")
    from deltaserve.kernels.sbmm import repack as repack_mod

    for bits, sparse in CONFIGS:
        p = random_packed(1024, 2048, bits, sparse, 64, seed=bits + sparse)
        want = repack(p.to("cpu"))
        w = make_delta_weights([None, p], layout="repacked")
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        w.store(0, p)
        torch.cuda.synchronize()
        assert torch.cuda.max_memory_allocated() - base <= repack_mod.TEMP_BUDGET * p.nbytes() + (1 << 20)
        for name, t in want.tensors().items():
            assert torch.equal(w._views(0).tensors()[name].cpu(), t), (bits, sparse, name)


# ---- the Triton kernel (kernels/sbmm/repack_triton.py): one launch, the torch path's words ----


def slot_of(like: PackedLinear, fill: int) -> tuple[PackedLinear, dict[str, torch.Tensor]]:
    """Views of ``like``'s shapes in the middle third of buffers three times their size, every word
    ``fill`` (so each word the kernel leaves unwritten, or writes outside the slot, shows)."""
    bufs, views = {}, {}
    for name, t in like.tensors().items():
        buf = torch.full((3 * t.numel(),), fill, dtype=torch.int32 if t.dtype == torch.int32 else torch.int16,
                         device=t.device)  # fmt: skip
        bufs[name] = buf
        views[name] = buf[t.numel() : 2 * t.numel()].view(t.dtype).view(t.shape)
    slot = PackedLinear(like.bits, like.sparse, like.group_size, like.out_features, like.in_features,
                        views["qvalues"], views.get("qindices"), views["scales"], views["zeros"])  # fmt: skip
    return slot, bufs


def assert_only_the_slot_written(bufs: dict[str, torch.Tensor], fill: int) -> None:
    for name, buf in bufs.items():
        n = buf.numel() // 3
        assert bool((buf[:n] == fill).all()) and bool((buf[2 * n :] == fill).all()), f"{name}: wrote outside the slot"


@pytest.mark.parametrize("shape", [(128, 512), (256, 768)], ids=["128x512", "256x768"])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_triton_repack_equals_torch(config: tuple[int, bool], group: int, shape: tuple[int, int]) -> None:
    """``repack`` / ``unpack`` through the Triton kernel (interpreted on CPU), into a slot's views of bigger
    buffers, write the torch path's words, every word of the slot and nothing outside it."""
    bits, sparse = config
    p = random_packed(*shape, bits, sparse, group, seed=zlib.crc32(f"{config}{group}{shape}".encode()))
    want = repack(p, use_triton=False)
    fill = -0x5A5B  # a 16-bit pattern the codes are unlikely to hold word for word
    slot, bufs = slot_of(p, fill)
    assert repack(p, out=slot, use_triton=True) is slot
    for name, t in want.tensors().items():
        assert torch.equal(slot.tensors()[name], t), name
    assert_only_the_slot_written(bufs, fill)
    back, back_bufs = slot_of(p, fill)
    unpack(slot, out=back, use_triton=True)
    for name, t in p.tensors().items():
        assert torch.equal(back.tensors()[name], t), name
    assert_only_the_slot_written(back_bufs, fill)


def test_repack_dispatch_follows_the_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """``repack`` / ``unpack`` launch the Triton kernel where ``kernels.common`` says Triton runs (CUDA by
    default; the ``triton`` backend on CPU, interpreted) and run the torch code otherwise; a pool's
    ``store`` and ``packed`` go through them."""
    from deltaserve.kernels import common as kernel_common
    from deltaserve.kernels.sbmm import repack_triton

    calls: list[bool] = []
    real = repack_triton.convert_triton

    def counted(p: PackedLinear, dst: PackedLinear, to_frag: bool) -> PackedLinear:
        calls.append(to_frag)
        return real(p, dst, to_frag)

    monkeypatch.setattr(repack_triton, "convert_triton", counted)
    p = random_packed(128, 256, 4, True, 64, seed=21)
    for backend, want in (("auto", DEVICE.type == "cuda"), ("torch", False), ("triton", True)):
        previous = kernel_common.set_backend(backend)
        try:
            calls.clear()
            w = make_delta_weights([None, p], layout="repacked")
            got = w.packed(1)
        finally:
            kernel_common.set_backend(previous)
        assert calls == ([True, False] if want else []), backend
        for name, t in p.tensors().items():
            assert torch.equal(got.tensors()[name], t), (backend, name)
    strided = dataclasses.replace(p, qvalues=p.qvalues.t().contiguous().t(), scales=p.scales.t().contiguous().t())
    assert not strided.qvalues.is_contiguous()
    want_words = repack(p, use_triton=False)
    for name, t in repack(strided, use_triton=True).tensors().items():
        assert torch.equal(t, want_words.tensors()[name]), name
