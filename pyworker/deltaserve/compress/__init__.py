"""ΔCompress: offline compression of a full fine-tune into a packed 2:4-sparse, 2/4-bit delta (DeltaZip §4).

Layout (the data flow of ``python -m deltaserve.compress``, i.e. ``deltaserve compress``):

- ``calib``       calibration set: JSONL texts / token ids (or built-in texts) -> token sequences
- ``obs``         one layer's solver: SparseGPT/OBS joint 2:4 mask + group quantization of Δ under
                  the Hessian of its calibration inputs; ``rtn_compress`` is the naive baseline
- (the packed format of one linear delta it writes, ``PackedLinear``, ``pack``, ``unpack``,
  ``dequantize``, is ``deltaserve.formats.packed_delta``'s, re-exported here)
- ``compressor``  Algorithm 1: layer by layer through the repo's ``DecoderLayer``, compressing each
                  HF linear and feeding the *reconstructed* layer's outputs to the next
- ``delta_dir``   the directory on disk (manifest + safetensors payload), ``load_delta``,
                  ``check_lineage``, and ``materialize`` (``W_base + dequant(Δ̃)`` as an HF dir)
- ``__main__``    the command line
"""

from ..formats.packed_delta import PackedLinear, dequantize, pack, unpack
from .delta_dir import (
    DeltaFormatError,
    DeltaLineageError,
    check_lineage,
    load_delta,
    materialize,
    read_manifest,
)

__all__ = [
    "DeltaFormatError", "DeltaLineageError", "check_lineage", "load_delta", "materialize", "read_manifest",
    "PackedLinear", "dequantize", "pack", "unpack",
]  # fmt: skip
