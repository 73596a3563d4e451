"""Import layers of the Python package: a low layer never imports a higher one (no package cycle).

``kernels -> compress -> model -> kernels`` was a package cycle: the SBMM kernels read the packed
delta format from ``compress.pack``, and importing ``deltaserve.kernels.sbmm`` ran ``compress/__init__``,
which loads the model loader and decoder. The format now lives in the leaf ``deltaserve.formats``
(torch only). Each import runs in a fresh interpreter, so what this test process already imported
does not count.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

ABOVE_KERNELS = ("deltaserve.compress", "deltaserve.model", "deltaserve.adapters", "deltaserve.worker")
"""Packages that build on the kernels: importing a kernel must load none of them."""

LAYERS = {
    "deltaserve.formats.packed_delta": ABOVE_KERNELS + ("deltaserve.kernels",),
    "deltaserve.kernels.sbmm": ABOVE_KERNELS,
    "deltaserve.kernels.lora": ABOVE_KERNELS,
    "deltaserve.kernels.dense_delta": ABOVE_KERNELS,
    "deltaserve.kernels.segments": ABOVE_KERNELS,
}
"""Module -> the package prefixes its import must not load."""


def imported_by(module: str) -> list[str]:
    """The ``deltaserve`` modules a fresh interpreter has loaded after ``import module``."""
    code = f"import sys, {module}; print('\\n'.join(sorted(m for m in sys.modules if m.startswith('deltaserve'))))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"import {module} failed:\n{done.stderr[-4000:]}"
    return done.stdout.split()


@pytest.mark.parametrize("module", sorted(LAYERS))
def test_module_does_not_import_a_higher_layer(module: str) -> None:
    forbidden = [m for m in imported_by(module) if m.startswith(LAYERS[module])]
    assert not forbidden, f"import {module} loads {forbidden}"


def test_formats_is_a_leaf() -> None:
    """``deltaserve.formats`` imports nothing of deltaserve but itself."""
    loaded = imported_by("deltaserve.formats.packed_delta")
    assert all(m == "deltaserve" or m.startswith("deltaserve.formats") for m in loaded), loaded
