"""Triton's interpreter, patched once: the CPU test runs' speed-up of ``TRITON_INTERPRET=1``.

For every launch the interpreter rebinds ``triton.language``'s builtins to interpreted ones and puts
them back afterwards (``triton.runtime.interpreter._patch_lang``): an ``inspect.getmembers`` over each
language module, ~1.5 ms a launch, which was more than half the time of the interpreted kernel tests
on a 2-core machine (a cProfile of ``test_split_attention_steps_match_the_reference[static]``: 66 s
of 107 s). Under ``TRITON_INTERPRET`` every kernel of the process is interpreted, so the language can
stay rebound: ``keep_language_patched`` makes the first launch of each set of language modules patch
them and every later launch reuse that, with the same interpreted functions. Nothing changes when the
interpreter is not in use, or when its internals are not the ones this knows (the original stays).
"""

from __future__ import annotations

import inspect
import os


def keep_language_patched() -> bool:
    """Installs the patch-once ``_patch_lang`` when kernels are interpreted; returns whether it did."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    original = getattr(interpreter, "_patch_lang", None)
    if original is None or getattr(original, "_keeps_language_patched", False):
        return False
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
