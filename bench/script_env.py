"""What a benchmark script sets up before it first imports triton or ``deltaserve``, in one call:

    from bench import script_env

    script_env.prepare()  # --smoke: kernels in the Triton CPU interpreter; pyworker/ importable
    import torch  # noqa: E402
    from deltaserve... import ...  # noqa: E402

It imports nothing heavy itself (no torch, no triton), so calling it first is enough.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

PYWORKER = Path(__file__).resolve().parents[1] / "pyworker"
"""The worker package's source root: ``deltaserve`` imports from the checkout without an install."""


def prepare(argv: list[str] | None = None) -> bool:
    """Puts ``pyworker/`` first on ``sys.path`` and, when ``--smoke`` is among ``argv`` (default
    ``sys.argv``), sets ``TRITON_INTERPRET=1`` (triton reads it when a kernel module is first
    imported: the kernels then run in the CPU interpreter). Returns whether ``--smoke`` was given."""
    smoke = "--smoke" in (sys.argv if argv is None else argv)
    if smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    if sys.path[:1] != [str(PYWORKER)]:
        sys.path.insert(0, str(PYWORKER))
    return smoke
