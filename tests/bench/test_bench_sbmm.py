"""bench/bench_sbmm.py's CPU parts: random packed deltas, a pool, a sweep point (its check against the
reference) and the launch record of a CUDA row (``sbmm.cuda_split``), so the script does not rot
between GPU runs. The timings themselves need a GPU (``python -m bench.bench_sbmm``)."""

from __future__ import annotations

import torch

from bench import bench_sbmm
from deltaserve.kernels import sbmm as sbmm_module


def test_a_sweep_point_checks_on_the_cpu_and_has_no_cuda_split() -> None:
    cpu = torch.device("cpu")
    assert bench_sbmm.parse_shape("64x128") == (64, 128)
    pool = bench_sbmm.Pool(32, 128, 4, True, 2, cpu)
    assert pool.weights.packed(1).out_features == 32 and pool.slot_bytes > 0
    for mode in ("decode", "prefill"):
        pt = bench_sbmm.Point(pool, batch=2, num_deltas=2, mode=mode, prefill_len=3, dense_max_bytes=1e9, device=cpu)
        assert pt.tokens == (2 if mode == "decode" else 6)
        pt.check()  # Triton (interpreted) and the dense baselines against the torch reference
        assert not pt.cuda_ok()
        assert sbmm_module.cuda_split(pt.cuda_meta, pool.weights) is None
        assert sbmm_module.launch_config(pt.meta, pool.weights)
