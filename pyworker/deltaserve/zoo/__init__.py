"""The block zoo (BlockLLM): fine-tunes stored as chains of base runs and own blocks, each identical
block stored once, every block's equivalence to the base's measured and recorded.

Layout (the data flow of ``python -m deltaserve.zoo add|ls|rm``):

- ``blocks``    the components of a decoder (embedding, per-layer attention, per-layer FFN, final
                norm + lm_head), which tensors each holds, content hashes
- ``lens``      equivalence: the logit lens similarity of each block against the base's
- ``manifest``  the zoo directory and its versioned manifest (validated, written atomically)
- ``add``       ``zoo add``: partition, dedup, equivalence sharing (opt-in), own blocks as ΔCompress
                deltas (``compress``) or dense, and a served delta directory per variant
- ``catalog``   ``zoo ls`` (chains, sharing, bytes saved) and ``zoo rm`` (garbage collection)
- ``__main__``  the command line

Serving: ``deltaserve --zoo DIR`` serves every variant stored as deltas through the compressed-delta
machinery (``variants/<name>/`` is a partial delta directory), as ``<base>:<name>``.
"""

from .add import AddOptions, add_variant
from .catalog import describe, remove_variant, sizes
from .manifest import ZooError, read_manifest

__all__ = ["AddOptions", "add_variant", "describe", "remove_variant", "sizes", "ZooError", "read_manifest"]
