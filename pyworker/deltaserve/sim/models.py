"""The bundled latency models (``models/<name>.json`` beside this file) and how the default one is
derived from the committed benchmark results (:func:`bench_samples`, :func:`fit_default`).

``llama-2-7b-H200`` (the default) is fitted on these files of ``bench/results`` (all Llama-2-7B
shape, fp16, NVIDIA H200):

    decode_step-overlap-NVIDIA_H200-2026-11-22.json   base decode, batch 1..256, KV 512, graphs,
                                                      overlapped step period (as the daemon runs)
    lora_mixed_step-NVIDIA_H200-2026-11-22.json       decode (batch 64) with 4 shared / 64 distinct
                                                      adapters, prefills of 1024 tokens with and
                                                      without adapters, 48 decodes + a 512 prefill
    delta_decode_step-NVIDIA_H200-2026-11-24.json     decode (batch 64, graphs) with 0 / 1 / 8 deltas;
                                                      the delta load (disk -> host -> GPU)
    prefill-NVIDIA_H200-2026-11-21.json               base prefill of 1 x 2048 and 16 x 512 tokens
    lora_decode_step-NVIDIA_H200-2026-11-22.json      LoRA loads of ranks 8..128: disk -> host and
                                                      host -> GPU bandwidths, pages per rank
    decode_step-overlap-NVIDIA_H200-2026-11-22.json   also: KV bytes per token and weight bytes

Memory: the KV pool of one H200 (141 GiB) at the daemon's default ``--gpu-memory-utilization``
0.9, less the weights and an activation reserve of 2 GiB (an estimate: the worker profiles it).
Regenerate with ``python -m deltaserve.sim fit-default --results bench/results``.
"""

from __future__ import annotations

import json
import math
from functools import cache
from pathlib import Path
from typing import Any

from deltaserve.sim.latency import LatencyModel, Memory

MODELS_DIR = Path(__file__).with_name("models")
"""Where the bundled models live."""
DEFAULT_MODEL = "llama-2-7b-H200"
"""The model ``replay`` and ``plan`` use unless given one."""
S2_RANKS = (64, 32, 16, 8)
"""The LoRA ranks of ``lora_mixed_step`` (round-robin over its adapters)."""
DEFAULT_FILES = {
    "decode": "decode_step-overlap-NVIDIA_H200-2026-11-22.json",
    "lora": "lora_mixed_step-NVIDIA_H200-2026-11-22.json",
    "delta": "delta_decode_step-NVIDIA_H200-2026-11-24.json",
    "prefill": "prefill-NVIDIA_H200-2026-11-21.json",
    "lora_load": "lora_decode_step-NVIDIA_H200-2026-11-22.json",
}
"""The committed results the default model is fitted on (module docstring)."""
H200_BYTES = 141 * 2**30
ACTIVATION_RESERVE = 2 * 2**30


def bundled_models() -> list[str]:
    """Names of the bundled models (``--gpu-kind`` values)."""
    return sorted(p.stem for p in MODELS_DIR.glob("*.json"))


@cache
def _load(name: str) -> LatencyModel:
    path = MODELS_DIR / f"{name}.json"
    if not path.is_file():
        raise ValueError(f"no bundled latency model {name!r}; bundled: {', '.join(bundled_models())}")
    return LatencyModel.load(path)


def bundled_model(name: str) -> LatencyModel:
    """A bundled model by name (a fresh copy)."""
    return LatencyModel.from_dict(_load(name).to_dict())


def default_model() -> LatencyModel:
    """The default model (:data:`DEFAULT_MODEL`)."""
    return bundled_model(DEFAULT_MODEL)


def _decode(b: int, kv: int, **kw: Any) -> dict[str, Any]:
    return {"tokens": b, "seqs": b, "context_tokens": b * (kv + 1), **kw}


def _lora(ids: list[int]) -> dict[str, float]:
    """LoRA features of requests using adapters ``ids`` (adapter a has rank S2_RANKS[a % 4])."""
    distinct = sorted(set(ids))
    return {"lora_segments": len(distinct), "lora_rank_sum": sum(S2_RANKS[a % 4] for a in distinct)}


def bench_samples(results: Path) -> list[dict[str, Any]]:
    """Measured steps from the committed results (:data:`DEFAULT_FILES`) as profile samples."""
    read = {k: json.loads((Path(results) / f).read_text()) for k, f in DEFAULT_FILES.items()}
    samples: list[dict[str, Any]] = []
    dec = read["decode"]
    for r in dec["rows_graphs"]:
        samples.append(_decode(r["batch"], dec["kv_len"], step_s=r["overlapped_step_ms"] / 1e3))
    lora = read["lora"]
    for r in lora["decode"]:
        b = r["batch"]
        ids = {"base": [], "4 shared": [i % 4 for i in range(b)], "64 distinct": list(range(b))}[r["case"]]
        extra = {**_lora(ids), "lora_tokens": len(ids)} if ids else {}
        samples.append(_decode(b, r["kv_len"], step_s=r["step_ms"] / 1e3, **extra))
    for r in lora["prefill"]:
        seqs, length = r["seqs"], r["length"]
        ids = {"base": [], "one adapter": [0] * seqs, "distinct": list(range(seqs))}[r["case"]]
        s = {"tokens": seqs * length, "seqs": seqs, "prefill_tokens": seqs * length,
             "context_tokens": seqs * length, "prefill_attention": seqs * length * length,
             "step_s": r["wall_ms"] / 1e3}  # fmt: skip
        if ids:
            s.update(_lora(ids), lora_tokens=seqs * length)
        samples.append(s)
    for r in lora["mixed"]:
        d, p = r["decoding"], r["prefill"]
        ids = {"base": [], "4 shared": [i % 4 for i in range(d + 1)], "distinct": list(range(d)) + [64]}[r["case"]]
        s = {"tokens": d + p, "seqs": d + 1, "prefill_tokens": p, "context_tokens": d * 513 + p,
             "prefill_attention": p * p, "step_s": r["wall_ms"] / 1e3}  # fmt: skip
        if ids:
            s.update(_lora(ids), lora_tokens=d + p)
        samples.append(s)
    delta = read["delta"]
    for r in delta["rows"]:
        if r["mode"] != "graphs":
            continue
        k = 0 if r["case"] == "base" else int(r["case"].split()[0])
        extra = {"deltas": k, "delta_tokens": delta["batch"]} if k else {}
        samples.append(_decode(delta["batch"], delta["kv_len"], step_s=r["step_ms"] / 1e3, **extra))
    for r in read["prefill"]["rows"]:
        seqs, length = (int(x) for x in r["case"].split("x"))
        samples.append({"tokens": seqs * length, "seqs": seqs, "prefill_tokens": seqs * length,
                        "context_tokens": seqs * length, "prefill_attention": seqs * length * length,
                        "step_s": r["step_ms"] / 1e3})  # fmt: skip
    return samples


def fit_default(results: Path) -> LatencyModel:
    """The default model from the committed results (module docstring)."""
    read = {k: json.loads((Path(results) / f).read_text()) for k, f in DEFAULT_FILES.items()}
    loads = read["lora_load"]["load_rows"]
    dl = read["delta"]["load"]
    dec = read["decode"]
    kv_pool = int(H200_BYTES * 0.9) - dec["weight_bytes"] - ACTIVATION_RESERVE
    top = max(loads, key=lambda r: r["rank"])
    memory = Memory(
        kv_bytes_per_token=dec["kv_bytes_per_token"],
        kv_pool_bytes=kv_pool,
        max_model_len=4096,
        lora_pages_per_rank=top["num_blocks"] / top["rank"],
        lora_bytes_per_rank=top["bytes"] // top["rank"],
        delta_bytes=dl["bytes"],
    )
    if not all(math.ceil(r["rank"] * memory.lora_pages_per_rank) == r["num_blocks"] for r in loads):
        raise ValueError(f"{DEFAULT_FILES['lora_load']}: LoRA pages are not ceil(rank x {memory.lora_pages_per_rank})")
    return LatencyModel.fit(
        bench_samples(results),
        disk_to_host_bps={"lora": sum(r["bytes"] for r in loads) / sum(r["disk_to_host_ms"] / 1e3 for r in loads),
                          "delta": dl["bytes"] / (dl["disk_to_host_ms"] / 1e3)},
        host_to_gpu_bps={"lora": sum(r["bytes"] for r in loads) / sum(r["host_to_gpu_ms"] / 1e3 for r in loads),
                         "delta": dl["bytes"] / (dl["host_to_gpu_ms"] / 1e3)},
        memory=memory,
        device="NVIDIA H200",
        source="bench/results: " + ", ".join(DEFAULT_FILES.values()),
    )  # fmt: skip
