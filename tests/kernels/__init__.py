"""Tests of ``deltaserve.kernels``: each Triton op against its torch reference (under
``TRITON_INTERPRET=1`` on CPU, set by tests/conftest.py; on CUDA with ``DELTASERVE_TEST_GPU=1``)."""
