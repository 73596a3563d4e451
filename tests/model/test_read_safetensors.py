"""``deltaserve._native.read_safetensors_into`` (crate ``tensorfile``) against torch: what the LoRA
host tier and ``load_lora_adapter`` read every adapter with.

Conversions equal torch's ``Tensor.to`` bit for bit (round to nearest even) for every pair of
float16 / bfloat16 / float32, plain and transposed, at offsets; NaN and both infinities are found
wherever they are, in every dtype; a finite value the conversion overflows is refused; a copy that
does not fit the buffer, or a buffer of the wrong alignment, writes nothing.
``read_safetensors_header`` lists what ``safetensors.safe_open`` lists.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from deltaserve._native import read_safetensors_header, read_safetensors_into

DTYPES = {torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32"}


def _read(path: Path, copies, out: torch.Tensor | None, dtype: torch.dtype) -> None:
    if out is None:
        read_safetensors_into(path, copies, DTYPES[dtype])
    else:
        read_safetensors_into(path, copies, DTYPES[dtype], out.data_ptr(), out.numel() * out.element_size())


@pytest.mark.parametrize("src", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("dst", DTYPES, ids=lambda d: str(d)[6:])
def test_conversions_and_transposes_equal_torch(src: torch.dtype, dst: torch.dtype, tmp_path: Path) -> None:
    gen = torch.manual_seed(0)
    # Values in float16's range, with many that are not representable in the narrower types.
    a = (torch.randn(5, 7, generator=gen, dtype=torch.float64) * 300).to(src)
    b = (torch.randn(7, 3, generator=gen, dtype=torch.float64) / 300).to(src)
    save_file({"a": a, "b": b}, tmp_path / "t.safetensors")
    out = torch.full((2 + 35 + 21 + 4,), -7.0, dtype=dst)
    _read(tmp_path / "t.safetensors", [("a", 5, 7, 2, False), ("b", 7, 3, 37, True)], out, dst)
    assert torch.equal(out[2:37].view(5, 7), a.to(dst))
    assert torch.equal(out[37:58].view(3, 7), b.to(dst).T)
    assert torch.equal(out[:2], torch.full((2,), -7.0, dtype=dst)), "nothing written before the copies"
    assert torch.equal(out[58:], torch.full((4,), -7.0, dtype=dst)), "nothing written after the copies"


@pytest.mark.parametrize("src", DTYPES, ids=lambda d: str(d)[6:])
def test_non_finite_values_are_found_anywhere(src: torch.dtype, tmp_path: Path) -> None:
    base = torch.randn(8, 33).to(src)
    save_file({"t": base}, tmp_path / "ok.safetensors")
    for dst in DTYPES:
        _read(tmp_path / "ok.safetensors", [("t", 8, 33, 0, False)], None, dst)
    for bad in (float("nan"), float("inf"), -float("inf")):
        for where in ((0, 0), (7, 32), (3, 17)):
            t = base.clone()
            t[where] = bad
            path = tmp_path / "bad.safetensors"
            save_file({"t": t}, path)
            out = torch.zeros(8 * 33, dtype=torch.float32)
            msg = rf"tensor 't' contains non-finite values \(NaN or inf\), first at \[{where[0]}, {where[1]}\]"
            with pytest.raises(ValueError, match=msg):
                _read(path, [("t", 8, 33, 0, False)], out, torch.float32)
            with pytest.raises(ValueError, match=msg):
                _read(path, [("t", 8, 33, 0, False)], None, torch.float32)


def test_overflow_in_the_target_dtype_is_refused(tmp_path: Path) -> None:
    t = torch.ones(2, 3)
    t[1, 2] = 1e6  # finite in float32 and bfloat16, not in float16
    save_file({"t": t}, tmp_path / "t.safetensors")
    copies = [("t", 2, 3, 0, False)]
    for out in (None, torch.zeros(6, dtype=torch.float16)):
        with pytest.raises(
            ValueError, match=r"'t' overflows torch.float16 \(non-finite after the cast\), first at \[1, 2\]"
        ):
            _read(tmp_path / "t.safetensors", copies, out, torch.float16)
    out = torch.zeros(6, dtype=torch.bfloat16)
    _read(tmp_path / "t.safetensors", copies, out, torch.bfloat16)
    assert torch.equal(out.view(2, 3), t.to(torch.bfloat16))


def test_bad_copies_and_buffers_write_nothing(tmp_path: Path) -> None:
    save_file({"t": torch.ones(2, 2, dtype=torch.float16)}, tmp_path / "t.safetensors")
    path = tmp_path / "t.safetensors"
    out = torch.zeros(6, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"copy of tensor 't' \(4 elements at 3\) does not fit a destination of 6"):
        _read(path, [("t", 2, 2, 0, False), ("t", 2, 2, 3, False)], out, torch.float16)
    assert not out.any()
    with pytest.raises(ValueError, match="not aligned"):
        read_safetensors_into(path, [("t", 2, 2, 0, False)], "F16", out.data_ptr() + 1, 8)
    with pytest.raises(ValueError, match="dst_dtype must be F16, BF16 or F32"):
        read_safetensors_into(path, [], "F64")
    with pytest.raises(ValueError, match=r"tensor 't' has shape \[2, 2\], expected \[4, 1\]"):
        _read(path, [("t", 4, 1, 0, False)], out, torch.float16)
    with pytest.raises(ValueError, match="tensor 'u' is not in the file"):
        _read(path, [("u", 2, 2, 0, False)], out, torch.float16)
    with pytest.raises(FileNotFoundError):
        _read(tmp_path / "missing.safetensors", [], None, torch.float16)
    assert not out.any()


def test_header_lists_what_safe_open_lists(tmp_path: Path) -> None:
    from safetensors import safe_open

    tensors = {
        "x.lora_A.weight": torch.zeros(4, 16, dtype=torch.bfloat16),
        "x.lora_B.weight": torch.zeros(32, 4),
        "n": torch.zeros(3, dtype=torch.int64),
    }
    save_file(tensors, tmp_path / "t.safetensors", metadata={"format": "pt"})
    with safe_open(str(tmp_path / "t.safetensors"), framework="pt") as f:
        want = {k: (f.get_slice(k).get_dtype(), list(f.get_slice(k).get_shape())) for k in f.keys()}  # noqa: SIM118
    assert read_safetensors_header(tmp_path / "t.safetensors") == want
    (tmp_path / "bad.safetensors").write_bytes((1000).to_bytes(8, "little") + b"{}")
    with pytest.raises(ValueError, match="header length 1000 exceeds"):
        read_safetensors_header(tmp_path / "bad.safetensors")
    with pytest.raises(FileNotFoundError):
        read_safetensors_header(tmp_path / "missing.safetensors")
