"""The files a server reads for an experiment's variants, written under a work directory (kept
and reused by later runs with ``--work-dir``) by :func:`prepare_variants`.

LoRA variants (:func:`write_adapters`): random PEFT LoRA directories of the model's shape, every
point's adapters in one ``--lora-dir``. Each adapter gets its own ``adapter_config.json``; its
``adapter_model.safetensors`` links to one of ``--distinct-weights`` random weight files per rank
(so 2000 rank-64 adapters of Llama-2-7B do not need 270 GB of disk). Loading still reads and
copies every adapter separately; only the page cache is shared. Weights: A ~ N(0, 1/in),
B ~ N(0, 0.01²), lora_alpha = r; targets q, k, v, o (S-LoRA's).

Full fine-tunes (deltazip, :func:`write_full_variants`): the base is
``common.write_random_checkpoint`` (real fp16 safetensors: a delta's lineage check and the swap
baseline read real files) plus a word-level tokenizer (the daemon needs a tokenizer.json). For
deltaserve, ``--distinct-weights`` delta payloads (``common.write_random_delta_dir``: random 4-bit
2:4 codes, a valid delta of this base) are written; each variant gets its own directory with a
copy of one payload's manifest and a link to its payload (``--delta NAME=DIR``), and the daemon runs
with ``DELTASERVE_DELTA_PIECE_SHARING=off`` (``VariantFiles.env``): it would otherwise hold the
variants that link one payload as one delta (BlockLLM's sharing of identical pieces,
adapters/delta_blocks.py), which the distinct fine-tunes they stand for would not allow. For swap,
``--distinct-checkpoints`` real full checkpoints (the base itself and base + 1 % noise per further
one: a 7B fp16 checkpoint is 13.5 GB) back the variants' model directories (``--models-dir``),
each variant a link to one of them. Either way every variant is read and loaded on its own; only
the page cache is shared (both servers load from it).
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench import workload as wl
from bench.common import (
    SHAPES,
    checkpoint_tensor_shapes,
    lora_config,
    write_lora_weights,
    write_random_checkpoint,
    write_random_delta_dir,
    write_random_model_dir,
    write_word_tokenizer,
)
from bench.launch import demo_model_dir
from bench.serving.experiments import Experiment

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
"""Projections the generated adapters adapt (S-LoRA's choice)."""
DELTA_BITS, DELTA_SPARSE, DELTA_GROUP = 4, True, 64
"""The compressed deltas' format (DeltaZip's 4-bit 2:4)."""
FINETUNE_NOISE = 0.01
"""Swap's extra full checkpoints: the base + this × each tensor's scale of Gaussian noise."""


def write_adapters(root: Path, variants: list[wl.Variant], config: dict, distinct: int = 8,
                   weights: Path | None = None) -> Path:  # fmt: skip
    """A ``--lora-dir``: one subdirectory per variant, its weights a link to one of ``distinct``
    random files per rank (under ``weights``, default ``root/.weights``, which has no
    adapter_config.json; existing files there are reused)."""
    weights = weights or root / ".weights"
    weights.mkdir(parents=True, exist_ok=True)
    root.mkdir(parents=True, exist_ok=True)
    per_rank: dict[int, int] = {}
    for v in variants:
        if v.kind != "lora" or v.rank is None:
            raise ValueError(f"variant {v.name}: only LoRA variants can be generated here (kind {v.kind})")
        k = per_rank.get(v.rank, 0)
        per_rank[v.rank] = k + 1
        src = weights / f"r{v.rank}-{k % distinct}.safetensors"
        if not src.exists():
            write_lora_weights(src, config, v.rank, seed=v.rank * 1000 + k % distinct, targets=LORA_TARGETS)
        d = root / v.name
        d.mkdir(exist_ok=True)
        (d / "adapter_config.json").write_text(json.dumps(lora_config(v.rank, LORA_TARGETS), indent=1))
        link = d / "adapter_model.safetensors"
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(src)
    return root


def _fresh_dir(path: Path) -> Path:
    """``path`` emptied (it holds only links and small files this module wrote) and recreated."""
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


def checkpoint_bytes(config: dict) -> tuple[int, int]:
    """(fp16 bytes of a full checkpoint of ``config``, estimated bytes of one random 4-bit 2:4 delta
    payload: 0.4375 bytes per block-linear weight, fp16 for the rest)."""
    shapes = checkpoint_tensor_shapes(config)
    total = linear = 0
    for name, shape in shapes.items():
        n = math.prod(shape)
        total += n
        if name.startswith("model.layers.") and name.endswith("proj.weight"):
            linear += n
    return 2 * total, int(linear * 0.4375) + 2 * (total - linear)


def _gen_device(devices: str) -> str:
    """Where random checkpoints are drawn: CUDA (much faster at 7B) when the run uses a GPU."""
    return "cpu" if devices == "cpu" else "cuda"


def _drop_partial(checkpoint: Path) -> None:
    """Removes what an interrupted ``write_random_checkpoint`` of ``checkpoint`` left (it writes
    ``<name>.partial`` and renames it when done)."""
    shutil.rmtree(checkpoint.with_name(checkpoint.name + ".partial"), ignore_errors=True)


def _release_gpu(gen_device: str) -> None:
    """Gives this process's cached CUDA blocks back, so the server started next sees them free."""
    if gen_device == "cuda":
        import torch

        torch.cuda.empty_cache()


@dataclass
class VariantFiles:
    """What ``prepare_variants`` wrote for one server."""

    model_dir: Path | None
    """The base model the daemon serves (None: the demo model)."""
    lora_dir: Path | None
    """``--lora-dir`` of LoRA variants, or the swap baseline's ``--models-dir`` of full models."""
    deltas: dict[str, Path] = field(default_factory=dict)
    """Compressed delta directories by variant name (``--delta NAME=DIR``)."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment the server needs for these files (``ServerSpec.env``)."""


def write_base_checkpoint(work: Path, config: dict, gen_device: str) -> Path:
    """``work/base``: a random fp16 checkpoint of ``config`` with a word-level tokenizer, written
    once (an existing one is reused)."""
    base = work / "base"
    if not base.exists():
        t0 = time.perf_counter()
        _drop_partial(base)
        write_random_checkpoint(config, base, seed=0, device=gen_device)
        _release_gpu(gen_device)
        print(f"base checkpoint written in {time.perf_counter() - t0:.1f} s: {base}", flush=True)
    if not (base / "tokenizer.json").is_file():
        write_word_tokenizer(base, config["vocab_size"])
    return base


def write_full_variants(work: Path, out: Path, server: str, variants: list[wl.Variant], config: dict,
                        distinct_deltas: int, distinct_checkpoints: int, gen_device: str) -> VariantFiles:  # fmt: skip
    """The files ``server`` needs to serve the full fine-tunes ``variants`` (module docstring):
    the shared ones (base, payloads, checkpoints) under ``work``, reused when present; the
    per-variant directories (manifest copies, links) under ``out``, rewritten."""
    if server not in ("deltaserve", "swap", "fake"):
        raise SystemExit(f"--server {server}: full fine-tunes are served by deltaserve (compressed deltas) or swap "
                         "(whole models), not by the LoRA baselines")  # fmt: skip
    if server == "fake":  # answers any model name: no files
        return VariantFiles(model_dir=None, lora_dir=_fresh_dir(out))
    if distinct_deltas < 1 or distinct_checkpoints < 1:
        raise SystemExit("--distinct-weights and --distinct-checkpoints must be >= 1")
    full_bytes, delta_bytes = checkpoint_bytes(config)
    base = work / "base"
    need = 0 if base.exists() else full_bytes
    if server == "deltaserve":
        payloads = [work / f"delta-payloads-{DELTA_BITS}bit-2of4" / f"w{k}" for k in range(distinct_deltas)]
        need += delta_bytes * sum(not (d / "manifest.json").is_file() for d in payloads)
    elif server == "swap":
        finetunes = [work / "finetunes" / f"ft{k}" for k in range(1, distinct_checkpoints)]
        need += full_bytes * sum(not d.exists() for d in finetunes)
    work.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(work).free
    if need > 0.95 * free:
        raise SystemExit(f"{work}: {need / 1e9:.1f} GB of model files to write, {free / 1e9:.1f} GB free; lower "
                         "--distinct-weights / --distinct-checkpoints or pick another --work-dir")  # fmt: skip
    base = write_base_checkpoint(work, config, gen_device)
    out = _fresh_dir(out)
    if server == "deltaserve":
        from deltaserve.adapters.delta_blocks import SHARING_ENV
        from deltaserve.compress.delta_dir import MANIFEST, read_manifest

        for k, d in enumerate(payloads):
            if not (d / MANIFEST).is_file():
                if d.exists():
                    shutil.rmtree(d)  # an interrupted write: the manifest is renamed into place last
                t0 = time.perf_counter()
                write_random_delta_dir(base, d, DELTA_BITS, DELTA_SPARSE, DELTA_GROUP, seed=100 + k)
                print(f"delta payload {k} written in {time.perf_counter() - t0:.1f} s: {d}", flush=True)
        deltas = {}
        for i, v in enumerate(variants):
            src = payloads[i % len(payloads)]
            d = out / v.name
            d.mkdir()
            shutil.copyfile(src / MANIFEST, d / MANIFEST)
            payload = read_manifest(src)["payload"]["file"]
            (d / payload).symlink_to(src / payload)
            deltas[v.name] = d
        return VariantFiles(model_dir=base, lora_dir=None, deltas=deltas, env={SHARING_ENV: "off"})
    checkpoints = [base]  # swap
    for d in finetunes:
        if not d.exists():
            t0 = time.perf_counter()
            _drop_partial(d)
            write_random_checkpoint(config, d, seed=0, noise=FINETUNE_NOISE, noise_seed=int(d.name[2:]),
                                    device=gen_device)  # fmt: skip
            _release_gpu(gen_device)
            print(f"fine-tuned checkpoint written in {time.perf_counter() - t0:.1f} s: {d}", flush=True)
        if not (d / "tokenizer.json").is_file():
            write_word_tokenizer(d, config["vocab_size"])
        checkpoints.append(d)
    for i, v in enumerate(variants):
        (out / v.name).symlink_to(checkpoints[i % len(checkpoints)], target_is_directory=True)
    return VariantFiles(model_dir=base, lora_dir=out, deltas={})


def prepare_variants(exp: Experiment, server: str, variants: list[wl.Variant], work: Path, devices: str,
                     distinct_weights: int | None = None, distinct_checkpoints: int | None = None) -> VariantFiles:  # fmt: skip
    """The model and variant files ``server`` reads for ``exp``, under ``work`` (per shape)."""
    kinds = {v.kind for v in variants}
    shape_dir = work / exp.shape
    if kinds == {"full"}:
        if exp.shape == "demo":
            raise ValueError(f"{exp.name}: full fine-tunes need a random checkpoint shape, not the demo model")
        return write_full_variants(shape_dir, shape_dir / f"{exp.name}-{server}", server, variants,
                                   SHAPES[exp.shape], distinct_weights or exp.distinct_weights,
                                   distinct_checkpoints or exp.distinct_checkpoints, _gen_device(devices))  # fmt: skip
    if kinds != {"lora"}:
        raise ValueError(f"{exp.name}: variants of kinds {sorted(kinds)}: want all LoRA or all full fine-tunes")
    if exp.shape == "demo":
        model_dir, config_dir = None, demo_model_dir()
    else:
        model_dir = config_dir = write_random_model_dir(exp.shape, shape_dir / "random-model")
        if not (model_dir / "tokenizer.json").is_file():
            write_word_tokenizer(model_dir, SHAPES[exp.shape]["vocab_size"])
    config = json.loads((config_dir / "config.json").read_text())
    lora_dir = write_adapters(_fresh_dir(shape_dir / f"{exp.name}-adapters"), variants, config,
                              distinct_weights or exp.distinct_weights, weights=shape_dir / "lora-weights")  # fmt: skip
    return VariantFiles(model_dir=model_dir, lora_dir=lora_dir)
