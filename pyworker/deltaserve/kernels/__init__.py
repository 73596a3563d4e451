"""deltaserve's GPU kernels (Triton), one op per file, each next to its torch reference.

Imported as ``deltaserve.kernels``; the top-level ``kernels/`` of the repository links here, so
the kernels ship inside the ``deltaserve`` wheel and are still found where the layout says. Every op
follows one pattern: a ``Semantics:`` block and ``Shape:`` lines in its docstring, a torch
reference that is also the CPU path, a dispatching entry point (Triton on CUDA, the reference
elsewhere), a parametrized test under ``TRITON_INTERPRET=1`` and a benchmark against the
reference in ``bench/``.
"""
