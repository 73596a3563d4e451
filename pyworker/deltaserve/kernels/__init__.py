"""deltaserve's GPU kernels (Triton, and CUDA C++ where it pays), each op next to its torch reference.

Imported as ``deltaserve.kernels``; the top-level ``kernels/`` of the repository links here, so
the kernels ship inside the ``deltaserve`` wheel and are still found where the layout says. Every op
follows one pattern: a ``Semantics:`` block and ``Shape:`` lines in its docstring, a torch
reference that is also the CPU path, a dispatching entry point (Triton on CUDA, the reference
elsewhere), a parametrized test under ``TRITON_INTERPRET=1`` and a benchmark against the
reference in ``bench/``.

- ``lora/``           multi-LoRA shrink / expand (SGMV for prefill, MBGMV for decode), one package
- ``sbmm/``           compressed full-fine-tune deltas (packed 2/4-bit, 2:4), Triton and csrc/sbmm.cu
- ``segments``        a step's tokens grouped by variant slot: what LoRA and SBMM metadata build on
- ``dense_delta``     dense lm_head / embedding deltas of every logits row, one launch
- ``paged_attention`` decode and ragged prefill over the paged KV cache (host side; the Triton
                      programs in ``paged_attention_kernels``)
- ``rmsnorm``, ``rope``, ``silu_mul``, ``region_copy``   one op per file
- ``common``          backend selection, bf16 rounding, launch-config files; ``cuda_ext`` builds csrc/

An op package holds its layout types, metadata, reference, one file per kernel family, and its tuned
launch configs as data (``configs/*.json``); its ``__init__`` is the entry points.
"""
