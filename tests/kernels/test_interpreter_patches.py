"""The test runs' patches of Triton's interpreter (``tests/helpers/triton_interpret.py``) answer as the
interpreter does: ``cache_np_dtypes`` gives the original ``_get_np_dtype``'s numpy dtype for every scalar,
block and pointer type, whichever of them it saw first; ``skip_discarded_overflow_checks`` switches off
only overflow checks whose verdict was discarded (``debug`` off), and kernels compute the same with them
on or off."""

from __future__ import annotations

import os

import pytest


def _interpreted():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the patches apply to interpreted runs only")
    from triton.runtime import interpreter

    return interpreter


def test_cached_np_dtypes_equal_the_interpreters() -> None:
    import triton.language as tl

    interpreter = _interpreted()
    cached = interpreter._get_np_dtype
    assert getattr(cached, "_cached_by_element", False), "conftest installs the cache"
    original = cached.original
    scalars = [tl.int1, tl.int8, tl.uint8, tl.int16, tl.uint16, tl.int32, tl.uint32, tl.int64, tl.uint64,
               tl.float16, tl.bfloat16, tl.float32, tl.float64, tl.float8e5, tl.float8e4nv]  # fmt: skip
    types = []
    for s in scalars:
        types += [tl.block_type(s, [4]), s, tl.pointer_type(s), tl.block_type(tl.pointer_type(s), [2, 8])]
    for t in types + types[::-1]:  # blocks first, then scalars first
        assert cached(t) == original(t), t


def test_overflow_checks_off_only_where_their_verdict_was_discarded(monkeypatch: pytest.MonkeyPatch) -> None:
    import dataclasses

    from helpers.triton_interpret import skip_discarded_overflow_checks

    interpreter = _interpreted()
    builder = interpreter.interpreter_builder
    assert not builder.options.debug and not builder.options.sanitize_overflow, "conftest switched them off"
    # with debug on, device_assert acts on the checks: they stay
    monkeypatch.setattr(builder, "options", dataclasses.replace(builder.options, debug=True, sanitize_overflow=True))
    assert not skip_discarded_overflow_checks() and builder.options.sanitize_overflow
    monkeypatch.setattr(builder, "options", dataclasses.replace(builder.options, debug=False))
    assert skip_discarded_overflow_checks() and not builder.options.sanitize_overflow


def test_int32_arithmetic_is_the_same_with_the_discarded_checks_on_or_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """Overflowing int32 products and sums wrap, and nothing raises, whether the checks run or not."""
    import dataclasses

    import torch
    import triton
    import triton.language as tl

    interpreter = _interpreted()

    @triton.jit
    def wrap(x_ptr, o_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        a = tl.load(x_ptr + i)
        tl.store(o_ptr + i, a * a + a - 7)

    x = torch.tensor([3, 2**16, 2**20, -(2**31) + 1, 2**31 - 1, 46341, -46341, 0], dtype=torch.int32)
    outs = []
    for sanitize in (True, False):
        options = dataclasses.replace(interpreter.interpreter_builder.options, sanitize_overflow=sanitize)
        monkeypatch.setattr(interpreter.interpreter_builder, "options", options)
        o = torch.empty_like(x)
        wrap[(1,)](x, o, N=8)
        outs.append(o)
    want = ((x.long() * x.long() + x.long() - 7 + 2**31) % 2**32 - 2**31).to(torch.int32)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[1], want)
