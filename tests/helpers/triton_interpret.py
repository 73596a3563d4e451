"""Triton's interpreter, patched once: the CPU test runs' speed-ups of ``TRITON_INTERPRET=1``.

For every launch the interpreter rebinds ``triton.language``'s builtins to interpreted ones and puts
them back afterwards (``triton.runtime.interpreter._patch_lang``): an ``inspect.getmembers`` over each
language module, ~1.5 ms a launch, which was more than half the time of the interpreted kernel tests
on a 2-core machine (a cProfile of ``test_split_attention_steps_match_the_reference[static]``: 66 s
of 107 s). Under ``TRITON_INTERPRET`` every kernel of the process is interpreted, so the language can
stay rebound: ``keep_language_patched`` makes the first launch of each set of language modules patch
them and every later launch reuse that, with the same interpreted functions. Nothing changes when the
interpreter is not in use, or when its internals are not the ones this knows (the original stays).

``cache_np_dtypes``: the interpreter maps a Triton type to its numpy dtype at every load, cast and
binary op (``_get_np_dtype``), building a table of 19 numpy dtypes each time: 12 s of a 163 s cProfile
of ``test_steps_without_adapter_rows_skip_the_row_list``. The answer depends only on the element type,
so it is kept per element type, computed by the original the first time.

``skip_discarded_overflow_checks``: the interpreter's options ask for integer-overflow sanitising
(``sanitize_overflow``), so every int32 add, sub and mul is redone in int64 and compared against the
type's bounds, but the result goes to ``device_assert``, which does nothing unless the options' ``debug``
is on (it is off): a check computed and thrown away, 31 % of a 246 s cProfile of
``test_steps_without_adapter_rows_skip_the_row_list``. With ``debug`` off the sanitising is switched off,
which checks exactly what was checked before (nothing); with ``debug`` on it stays.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from typing import Any


def _interpreter() -> Any | None:
    """Triton's interpreter module when kernels are interpreted (``TRITON_INTERPRET=1``), else None."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return None
    try:
        from triton.runtime import interpreter
    except ImportError:
        return None
    return interpreter


def _replaceable(name: str, marker: str) -> tuple[Any, Any, Any] | None:
    """(triton.language, the interpreter module, its function ``name``) when kernels are interpreted and that
    function exists and is not already this module's replacement (which carries attribute ``marker``); else
    None: then nothing is patched."""
    interpreter = _interpreter()
    if interpreter is None:
        return None
    import triton.language as tl

    original = getattr(interpreter, name, None)
    if original is None or getattr(original, marker, False):
        return None
    return tl, interpreter, original


def keep_language_patched() -> bool:
    """Installs the patch-once ``_patch_lang`` when kernels are interpreted; returns whether it did."""
    found = _replaceable("_patch_lang", "_keeps_language_patched")
    if found is None:
        return False
    tl, interpreter, original = found
    patched: set[tuple[int, ...]] = set()

    class _Kept:
        """The scope a launch restores after it runs: the language stays patched."""

        def restore(self) -> None:
            pass

    def patch_once(fn):  # noqa: ANN001, ANN202 (the interpreter's signature)
        langs = tuple(sorted(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)))
        if langs not in patched:
            original(fn)  # its scope is never restored
            patched.add(langs)
        return _Kept()

    patch_once._keeps_language_patched = True  # type: ignore[attr-defined]
    interpreter._patch_lang = patch_once
    return True


def cache_np_dtypes() -> bool:
    """Installs the element-type cache over the interpreter's ``_get_np_dtype`` when kernels are interpreted;
    returns whether it did."""
    found = _replaceable("_get_np_dtype", "_cached_by_element")
    if found is None:
        return False
    tl, interpreter, original = found
    by_element: dict[object, object] = {}

    def cached(tt_dtype):  # noqa: ANN001, ANN202 (the interpreter's signature)
        element = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        key = None if isinstance(element, tl.pointer_type) else element  # every pointer is a uint64
        np_dtype = by_element.get(key)
        if np_dtype is None:
            np_dtype = by_element[key] = original(tt_dtype)
        return np_dtype

    cached._cached_by_element = True  # type: ignore[attr-defined]
    cached.original = original  # type: ignore[attr-defined]
    interpreter._get_np_dtype = cached
    return True


def skip_discarded_overflow_checks() -> bool:
    """Switches the interpreter's overflow sanitising off where its checks are discarded (module docstring);
    returns whether it did."""
    builder = getattr(_interpreter(), "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if options is None or getattr(options, "debug", True) or not getattr(options, "sanitize_overflow", False):
        return False
    builder.options = dataclasses.replace(options, sanitize_overflow=False)
    return True
