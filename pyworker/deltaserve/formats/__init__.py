"""On-the-wire and on-disk formats that several layers read: leaves of the package graph.

- ``packed_delta``  the packed bit layout of one compressed linear delta (``PackedLinear``, ``pack``,
                    ``unpack``, ``dequantize``: THE reference value the kernels are tested against)

Modules here import torch and each other only, never the compressor, the model or the kernels,
so the kernels (``kernels.sbmm``) and the adapters can read a format without importing the
offline compressor (tests/package/test_import_layers.py checks it).
"""
