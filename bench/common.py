"""Shared pieces of the benchmarks: model shapes, the device-to-device copy bandwidth that every
memory floor is measured against, and the JSON result files (device, commit, shapes)."""

from __future__ import annotations

import datetime as _dt
import json
import os
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"

# Real shapes (random weights: real checkpoints cannot reach the GPU machine).
SHAPES: dict[str, dict] = {
    "llama-2-7b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000,
        "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 32, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "max_position_embeddings": 4096, "tie_word_embeddings": False,
        "torch_dtype": "float16", "bos_token_id": 1, "eos_token_id": 2,
    },
}


def write_random_model_dir(shape: str, out: Path, seed: int = 0) -> Path:
    """An HF-style directory whose weights the loader draws at random (``random-weights.json``)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(SHAPES[shape], indent=1))
    (out / "random-weights.json").write_text(json.dumps({"seed": seed, "std": 0.02}))
    return out


def lora_config(rank: int, targets) -> dict:
    """A PEFT ``adapter_config.json`` for a plain LoRA of ``rank`` on ``targets`` (alpha = rank)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": rank, "lora_dropout": 0.0,
            "target_modules": list(targets), "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
            "use_dora": False, "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {},
            "base_model_name_or_path": "random", "inference_mode": True}  # fmt: skip


def write_lora_weights(path: Path, config: dict, rank: int, seed: int, targets) -> None:
    """One random PEFT ``adapter_model.safetensors`` (float16) for ``config``'s shapes: benchmark data
    (small B so outputs stay finite), never a test reference."""
    import numpy as np
    from safetensors.numpy import save_file

    from deltaserve.adapters.lora import hf_module_name, projection_features
    from deltaserve.model.arch import ModelConfig

    rng = np.random.default_rng(seed)
    shapes = projection_features(ModelConfig.from_dict(config))
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for proj in targets:
            fan_in, fan_out = shapes[proj]
            key = f"base_model.model.{hf_module_name(layer, proj)}"
            a = rng.standard_normal((rank, fan_in), dtype=np.float32) / np.sqrt(fan_in)
            b = rng.standard_normal((fan_out, rank), dtype=np.float32) * 0.01
            tensors[f"{key}.lora_A.weight"] = a.astype(np.float16)
            tensors[f"{key}.lora_B.weight"] = b.astype(np.float16)
    save_file(tensors, str(path), metadata={"format": "pt"})


def write_random_lora_dir(out: Path, config: dict, rank: int, targets, seed: int = 0,
                          weights: Path | None = None) -> Path:
    """A PEFT adapter directory of random weights; ``weights``: link to that file instead of writing one
    (many adapters sharing a few weight files keep benchmark disk use small)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "adapter_config.json").write_text(json.dumps(lora_config(rank, targets), indent=1))
    dst = out / "adapter_model.safetensors"
    if weights is None:
        write_lora_weights(dst, config, rank, seed, targets)
    elif not dst.exists():
        dst.symlink_to(weights)
    return out


def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30, iters: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes // 2, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize(device)
    seconds = start.elapsed_time(end) / 1e3 / iters
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / seconds


def git_commit() -> str:
    """``$DELTASERVE_COMMIT`` when set (the GPU machine gets a copy of the tree, not the history), else HEAD."""
    if os.environ.get("DELTASERVE_COMMIT"):
        return os.environ["DELTASERVE_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("DELTASERVE_COMMIT", "unknown")


def bench_device(smoke: bool, device: str, script: str) -> tuple[torch.device, float | None, Callable]:
    """Where a kernel benchmark runs: ``(device, copy bandwidth in bytes/s or None, timer)``.

    ``smoke``: the CPU and the host timer, no bandwidth (a check that the script runs, under the
    Triton interpreter). Otherwise the CUDA ``device``, its copy bandwidth measured now (printed),
    and ``time_cuda``; exits with a message when there is no CUDA device.
    """
    if smoke:
        return torch.device("cpu"), None, time_host
    if not torch.cuda.is_available():
        raise SystemExit(f"{script} needs a CUDA device (or --smoke for a CPU check of the script)")
    dev = torch.device(device)
    torch.cuda.set_device(dev)
    bw = copy_bandwidth(dev)
    print(f"{device_name(dev)}: device-to-device copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    return dev, bw, time_cuda


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def write_result(experiment: str, payload: dict, out_dir: Path | None = None) -> Path:
    """Writes ``<experiment>-<device>-<date>.json`` with the device, commit and date added."""
    device = payload.get("device", "cpu").replace(" ", "_")
    date = _dt.date.today().isoformat()
    out_dir = out_dir or RESULTS
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{experiment}-{device}-{date}.json"
    payload = {"experiment": experiment, "commit": git_commit(), "date": date, **payload}
    path.write_text(json.dumps(payload, indent=1) + "\n")
    return path


def time_cuda(fn: Callable[[], object], graph: bool = False) -> float:
    """Median seconds per call of ``fn`` on the GPU (``triton.testing.do_bench``, L2 flushed), or
    replayed inside a CUDA graph when ``graph``."""
    import triton.testing

    if graph:  # captures on its own side stream; make the inputs' writes visible to it first
        torch.cuda.synchronize()
        return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median") / 1e3
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3


def time_host(fn: Callable[[], object], graph: bool = False, runs: int = 3) -> float:
    """--smoke runs: median wall clock on the CPU (the Triton interpreter); only checks a script runs."""
    del graph
    fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
