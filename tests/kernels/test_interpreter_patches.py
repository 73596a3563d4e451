"""The test runs' patches of Triton's interpreter (``tests/helpers/triton_interpret.py``) answer as the
interpreter does: ``cache_np_dtypes`` gives the original ``_get_np_dtype``'s numpy dtype for every scalar,
block and pointer type, whichever of them it saw first."""

from __future__ import annotations

import os

import pytest


def test_cached_np_dtypes_equal_the_interpreters() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the patches apply to interpreted runs only")
    import triton.language as tl
    from triton.runtime import interpreter

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
