"""Shared pieces of the benchmarks: model shapes, random model / adapter / delta directories (and
reading their config), the device-to-device copy bandwidth that every memory floor is measured
against, and the JSON result files (device, commit, shapes)."""

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
RANDOM_WEIGHTS_FILE = "random-weights.json"
"""Marks a model directory whose weights are drawn at random (``write_random_model_dir``; the
worker's loader and bench/baselines.py draw them)."""

# Real shapes (random weights: real checkpoints cannot reach the GPU machine).
SHAPES: dict[str, dict] = {
    "llama-2-7b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
}


def write_random_model_dir(shape: str, out: Path, seed: int = 0) -> Path:
    """An HF-style directory whose weights the loader draws at random (``random-weights.json``)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(SHAPES[shape], indent=1))
    (out / RANDOM_WEIGHTS_FILE).write_text(json.dumps({"seed": seed, "std": 0.02}))
    return out


def write_random_served_model(shape: str, out: Path, num_layers: int | None = None, seed: int = 0) -> Path:
    """A model directory the daemon can serve: ``shape`` (``num_layers`` overriding its layer count)
    with random weights and a word-level tokenizer over its whole vocabulary."""
    config = shape_config(shape, num_layers)
    write_random_model_dir(shape, out, seed)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    write_word_tokenizer(out, config["vocab_size"])
    return out


def write_word_tokenizer(out: Path, vocab_size: int) -> None:
    """A whitespace word-level tokenizer with ``vocab_size`` entries, so any id decodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))


def checkpoint_dtype(model_dir: Path) -> torch.dtype:
    """The dtype an HF directory's config.json names (float16 when it names none)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    return getattr(torch, cfg.get("torch_dtype") or cfg.get("dtype") or "float16")


def adapter_dirs(lora_dir: Path) -> dict[str, Path]:
    """Every subdirectory of ``lora_dir`` with an adapter_config.json, by name (the daemon's rule)."""
    found = {d.name: d for d in sorted(Path(lora_dir).iterdir()) if (d / "adapter_config.json").is_file()}
    if not found:
        raise SystemExit(f"--lora-dir {lora_dir}: no subdirectory has an adapter_config.json")
    return found


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


def write_random_lora_dir(
    out: Path, config: dict, rank: int, targets, seed: int = 0, weights: Path | None = None
) -> Path:
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
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
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


# ---------------------------------------------------------------- checkpoints and deltas on disk
# (compressed-delta benchmarks: a delta's lineage check and the compressor read real safetensors)

LLAMA2_7B_MODULES: dict[str, tuple[int, tuple[int, ...]]] = {
    "qkv": (4096, (4096, 4096, 4096)),
    "o": (4096, (4096,)),
    "gate_up": (4096, (11008, 11008)),
    "down": (11008, (4096,)),
}
"""Llama-2-7B's fused modules as the worker stacks them: (in_features, out_features of each HF
projection), for the per-module kernel benchmarks."""

SMOKE_SHAPE = "smoke-llama"
"""A tiny Llama shape for ``--smoke`` runs on the CPU (every linear fits the packed delta format)."""
SHAPES[SMOKE_SHAPE] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256,
    "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "max_position_embeddings": 512, "tie_word_embeddings": False,
    "torch_dtype": "float16", "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip


def shape_config(shape: str, num_layers: int | None = None) -> dict:
    """``SHAPES[shape]`` (a copy), with ``num_hidden_layers`` replaced when ``num_layers`` is given."""
    if shape not in SHAPES:
        raise SystemExit(f"--shape {shape!r}: unknown; known shapes: {', '.join(sorted(SHAPES))}")
    cfg = dict(SHAPES[shape])
    if num_layers is not None:
        if num_layers < 1:
            raise SystemExit(f"--num-layers must be >= 1, got {num_layers}")
        cfg["num_hidden_layers"] = num_layers
    return cfg


def checkpoint_tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape of every tensor an HF checkpoint of ``config`` holds (in the decoder's
    order; no ``lm_head.weight`` when the embeddings are tied)."""
    from deltaserve.model.arch import ModelConfig
    from deltaserve.model.decoder import DecoderLM

    cfg = ModelConfig.from_dict(config)
    with torch.device("meta"):
        layout = DecoderLM(cfg, dtype=torch.float16).checkpoint_layout()
    return {name: tuple(shape) for name, (_, _, shape) in layout.items()
            if not (cfg.tie_word_embeddings and name == "lm_head.weight")}  # fmt: skip


def _tensor_seed(seed: int, index: int) -> int:
    """A distinct generator seed per (run seed, tensor index)."""
    return (seed * 1_000_003 + index) % (2**63)


def write_random_checkpoint(
    config: dict,
    out: Path,
    seed: int = 0,
    std: float = 0.02,
    noise: float = 0.0,
    noise_seed: int = 1,
    device: str = "cpu",
) -> Path:
    """An HF directory of real float16 safetensors for ``config``: what ``random_model`` draws (matrices
    N(0, ``std``), norm weights 1, biases 0), but on disk, one shard per decoder layer plus one for
    the embedding, final norm and lm_head, with ``model.safetensors.index.json``.

    ``noise`` > 0 makes a "full fine-tune" of the same ``seed``'s checkpoint instead: every tensor
    moved by ``noise`` x its scale (``std``; 1 for norm weights) x N(0, 1) noise from ``noise_seed``.
    Each tensor is drawn on ``device`` ("cuda" is much faster for 7B shapes) from its own seed, so
    the same seed and device give the same base values in both calls. ``out`` must not exist yet.
    """
    from safetensors.torch import save_file

    if out.exists():
        raise ValueError(f"write_random_checkpoint: {out} already exists (refusing to overwrite)")
    shapes = checkpoint_tensor_shapes(config)
    dev = torch.device(device)
    shard_of: dict[str, int] = {}
    for name in shapes:
        parts = name.split(".")
        shard_of[name] = int(parts[2]) + 1 if parts[:2] == ["model", "layers"] else 0
    n_shards = max(shard_of.values()) + 1
    file_of = {k: f"model-{k + 1:05d}-of-{n_shards:05d}.safetensors" for k in range(n_shards)}
    tmp = out.with_name(out.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=False)
    index = {name: i for i, name in enumerate(shapes)}
    total = 0
    for shard in range(n_shards):
        tensors = {}
        for name in (n for n in shapes if shard_of[n] == shard):
            shape = shapes[name]
            is_norm, is_bias = name.endswith("norm.weight"), name.endswith(".bias")
            if is_norm or is_bias:
                base = torch.full(shape, 1.0 if is_norm else 0.0, dtype=torch.float32, device=dev)
            else:
                g = torch.Generator(device=dev).manual_seed(_tensor_seed(seed, index[name]))
                base = torch.randn(shape, generator=g, dtype=torch.float16, device=dev).float().mul_(std)
            if noise > 0:
                g = torch.Generator(device=dev).manual_seed(_tensor_seed(noise_seed, index[name]))
                scale = 1.0 if is_norm else std
                base.add_(torch.randn(shape, generator=g, dtype=torch.float16, device=dev).float(), alpha=noise * scale)
            tensors[name] = base.to(torch.float16).cpu().contiguous()
            total += tensors[name].numel() * 2
            del base
        save_file(tensors, str(tmp / file_of[shard]), metadata={"format": "pt"})
        del tensors
    weight_map = {name: file_of[shard_of[name]] for name in shapes}
    (tmp / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
    )
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    tmp.rename(out)
    return out


_VALID_PAIRS = [a | (b << 2) for a in range(4) for b in range(a + 1, 4)]
"""The 6 legal 4-bit pairs of 2:4 positions of one group of 4 (two increasing 2-bit positions)."""


def _index_byte_table() -> torch.Tensor:
    """Random byte -> a byte of two legal pairs (the qindices of two consecutive groups of 4)."""
    table = [_VALID_PAIRS[(v & 15) % 6] | (_VALID_PAIRS[(v >> 4) % 6] << 4) for v in range(256)]
    return torch.tensor(table, dtype=torch.uint8)


def random_packed_linear(
    out_features: int, in_features: int, bits: int, sparse: bool, group_size: int, generator: torch.Generator
):
    """A ``PackedLinear`` of random codes (any int32 word is legal ``qvalues``), random legal 2:4
    positions, scales in [1e-4, 3e-4] and integral zeros at the middle codes: values of a few 1e-3,
    like a fine-tune's delta. Benchmark data, vectorised; never a compressor output."""
    import sys

    from deltaserve.formats.packed_delta import PackedLinear

    if sys.byteorder != "little":
        raise RuntimeError("random_packed_linear builds qindices words from bytes: needs a little-endian host")
    kept = in_features // 2 if sparse else in_features
    words = (out_features, kept * bits // 32)
    qvalues = torch.empty(words, dtype=torch.int32).random_(-(2**31), 2**31, generator=generator)
    qindices = None
    if sparse:
        raw = torch.empty((out_features, kept // 16), dtype=torch.int32).random_(-(2**31), 2**31, generator=generator)
        qindices = _index_byte_table()[raw.view(torch.uint8).long()].view(torch.int32).contiguous()
    groups = (out_features, in_features // group_size)
    scales = (torch.rand(groups, generator=generator) * 2e-4 + 1e-4).to(torch.float16)
    mid = (1 << bits) // 2  # integral zero points next to the middle code, as the compressor writes them
    zeros = torch.randint(mid - 1, mid + 1, groups, generator=generator).to(torch.float16)
    return PackedLinear(bits, sparse, group_size, out_features, in_features, qvalues, qindices, scales, zeros)


def write_random_delta_dir(
    base_dir: Path,
    out: Path,
    bits: int = 4,
    sparse: bool = True,
    group_size: int = 64,
    seed: int = 0,
    dense_std: float = 1e-3,
) -> Path:
    """A valid delta directory (``compress/delta_dir.py``, mode "delta") for the base at ``base_dir``
    with RANDOM packed codes for every block linear (``random_packed_linear``) and N(0, ``dense_std``)
    float16 deltas for every other tensor (embedding, norms, lm_head when untied, biases), plus a
    manifest that passes ``check_lineage`` and ``load_delta``: what ``deltaserve compress`` would
    write, in seconds instead of hours (no calibration, no OBS; ``compression.method`` "random").

    ``base_dir`` needs real safetensors weights (``write_random_checkpoint``; lineage reads their
    shapes); ``out`` must be absent or empty. Benchmark data only.
    """
    from deltaserve.compress.delta_dir import (
        FORMAT,
        FORMAT_VERSION,
        as_json,
        checkpoint_shapes,
        model_signature,
        signature_hash,
        write_delta_dir,
    )
    from deltaserve.model.arch import ModelConfig
    from deltaserve.model.decoder import linear_slots

    started = time.monotonic()
    base_dir, out = Path(base_dir), Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"write_random_delta_dir: {out} exists and is not an empty directory")
    cfg = ModelConfig.from_model_dir(base_dir)
    if not any(base_dir.glob("*.safetensors")):
        raise ValueError(
            f"write_random_delta_dir: base {base_dir} has no *.safetensors weights (a delta's lineage "
            "check reads them; write the base with write_random_checkpoint)"
        )
    on_disk = {name: shape for name, (_, shape) in checkpoint_shapes(base_dir).items()}
    config = json.loads((base_dir / "config.json").read_text())
    shapes = checkpoint_tensor_shapes(config)
    if "lm_head.weight" not in on_disk:  # the loader ties a checkpoint without a head
        shapes.pop("lm_head.weight", None)
    linears = {f"model.layers.{i}.{slot.module.rpartition('.')[0]}.{proj}.weight"
               for i in range(cfg.num_layers) for proj, slot in linear_slots(cfg).items()}  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    packed, dense, entries = {}, {}, {}
    for name, shape in shapes.items():
        if name in linears:
            module = name.removesuffix(".weight")
            p = random_packed_linear(shape[0], shape[1], bits, sparse, group_size, gen)
            packed[module] = p
            entries[module] = {"kind": "packed", "shape": list(shape), "bytes": p.nbytes()}
        else:
            dense[name] = torch.randn(shape, generator=gen, dtype=torch.float16).mul_(dense_std)
            entries[name] = {"kind": "dense", "shape": list(shape), "bytes": dense[name].numel() * 2}
    sig = as_json(model_signature(cfg))
    fp16_bytes = sum(2 * torch.Size(s).numel() for s in shapes.values())
    manifest = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "mode": "delta",
        "base": {"name": base_dir.resolve().name, "config": sig, "config_sha256": signature_hash(sig)},
        "finetuned": {"name": f"random-seed{seed}", "config_sha256": signature_hash(sig)},
        "base_shapes": {name: list(shape) for name, shape in shapes.items()},
        "compression": {
            "bits": bits, "sparsity": "2:4" if sparse else "none", "group_size": group_size, "method": "random",
            "block_size": None, "percdamp": None,
            "calibration": {"source": "none", "samples": 0, "tokens": 0, "seqlen": 0},
        },
        "tensors": entries, "dropped": [], "sizes": {"finetuned_fp16_bytes": fp16_bytes}, "seconds": None,
    }  # fmt: skip
    manifest["seconds"] = round(time.monotonic() - started, 3)
    write_delta_dir(out, manifest, packed, dense)
    return out
