"""Build a ``DecoderLM`` from an HF directory (``load_model``) or with random weights (``random_model``).

Loading, in order, failing early with a message that names the offending file or tensor:

1. ``ModelConfig.from_model_dir`` (unsupported architectures / rope types and quantized
   checkpoints (``quantization_config``) are refused there, naming the field);
2. find the safetensors: ``model.safetensors.index.json`` (sharded) or every ``*.safetensors``;
   a directory with only pickle checkpoints (``*.bin``, ``*.pt``...) is refused, never unpickled;
3. read every file's header and check each expected HF tensor is present with the right shape
   (extras such as ``rotary_emb.inv_freq`` are ignored) and holds floating-point values (an FP8 /
   integer tensor is quantized: refused, never cast without its scales). Expected tensors are HF's names
   (``DecoderLM.checkpoint_layout``): the fused ``qkv_proj`` / ``gate_up_proj`` are checked as
   their HF parts, so messages name ``...self_attn.k_proj.weight``, not the fused tensor;
4. build the module on the meta device, materialise it on the target device (no CPU copy on
   CUDA), and copy each tensor in, casting to the chosen dtype; HF ``q_proj``/``k_proj``/``v_proj``
   (and ``gate_proj``/``up_proj``, weights and biases) land in their rows of the fused parameter
   (``decoder.linear_slots``), so a checkpoint is never concatenated in a temporary;
5. tie ``lm_head`` to ``embed_tokens`` when the config says so or the checkpoint has no lm_head.

A directory with a ``random-weights.json`` (``{"seed": 0, "std": 0.02}``) and no weight files is
loaded with ``random_model`` instead: real shapes, random values. Benchmarks use it to run real
model shapes (Llama-2-7B...) on machines that real checkpoints cannot reach.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from .arch import ModelConfig
from .decoder import DecoderLM

log = logging.getLogger(__name__)

RANDOM_WEIGHTS_FILE = "random-weights.json"
"""Marker file: serve the config's shapes with random weights (benchmarks only)."""
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
"""safetensors dtypes a weight may have; anything else (F8_E4M3, I8, U8, I32...) is quantized."""
_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}


def resolve_dtype(cfg: ModelConfig, device: torch.device | str, dtype: torch.dtype | None) -> torch.dtype:
    """``dtype`` if given; else the config's ``torch_dtype`` on CUDA, float32 elsewhere."""
    if dtype is not None:
        return dtype
    if torch.device(device).type != "cuda":
        return torch.float32
    name = (cfg.torch_dtype or "float32").removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"config.json: unsupported 'torch_dtype' {cfg.torch_dtype!r}; pass dtype= explicitly")
    return _DTYPES[name]


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of an HF directory, refusing pickle-only checkpoints."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index}: no 'weight_map'")
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise ValueError(f"{index}: shard '{f.name}' listed in weight_map does not exist")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p.name for p in model_dir.iterdir() if p.suffix in _PICKLE_SUFFIXES)
    if pickles:
        raise ValueError(
            f"{model_dir}: only pickle checkpoints found ({', '.join(pickles)}); deltaserve never "
            f"unpickles weights. Convert them to safetensors (e.g. transformers "
            f"save_pretrained(..., safe_serialization=True))."
        )
    raise ValueError(f"{model_dir}: no *.safetensors weights found")


def load_model(
    model_dir: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
) -> DecoderLM:
    """Load an HF checkpoint directory of an ``ARCH_TABLE`` architecture into a ``DecoderLM`` (module docstring)."""
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_model_dir(model_dir)
    dtype = resolve_dtype(cfg, device, dtype)
    random_spec = model_dir / RANDOM_WEIGHTS_FILE
    if random_spec.is_file() and not any(model_dir.glob("*.safetensors")):
        spec = json.loads(random_spec.read_text())
        log.warning("%s: no weights, drawing random ones (%s) for benchmarking", model_dir, spec)
        return random_model(cfg, device, dtype, seed=int(spec.get("seed", 0)), std=float(spec.get("std", 0.02)))
    files = checkpoint_files(model_dir)

    with torch.device("meta"):
        model = DecoderLM(cfg, dtype=dtype)
    layout = model.checkpoint_layout()
    expected = {name: shape for name, (_, _, shape) in layout.items()}

    located: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for f in files:
        with safe_open(f, framework="pt") as sf:
            for key in sf.keys():
                tensor = sf.get_slice(key)
                located[key] = (f, tuple(tensor.get_shape()))
                if key in expected and tensor.get_dtype() not in _FLOAT_DTYPES:
                    raise ValueError(
                        f"{f}: tensor '{key}' is stored as {tensor.get_dtype()}: a quantized checkpoint "
                        f"(FP8 / integer weights) is not supported; serve the float16 / bfloat16 checkpoint"
                    )

    tie = cfg.tie_word_embeddings or "lm_head.weight" not in located
    missing = [n for n in expected if n not in located and not (tie and n == "lm_head.weight")]
    if missing:
        shown = ", ".join(missing[:5]) + (f" (and {len(missing) - 5} more)" if len(missing) > 5 else "")
        raise ValueError(f"{model_dir}: checkpoint is missing tensor(s) {shown}")
    for name, shape in expected.items():
        if name in located and located[name][1] != shape and not (tie and name == "lm_head.weight"):
            raise ValueError(
                f"{located[name][0]}: tensor '{name}' has shape {list(located[name][1])}, "
                f"expected {list(shape)} from config.json"
            )
    extras = sorted(set(located) - set(expected))
    if extras:
        log.debug("ignoring %d unexpected checkpoint tensors, e.g. %s", len(extras), extras[:3])

    model.to_empty(device=device)
    if tie:
        model.tie_weights()
    params = dict(model.named_parameters())  # a tied lm_head.weight is not listed: nothing to copy
    by_file: dict[Path, list[str]] = {}
    for name, (pname, _, _) in layout.items():
        if name in located and pname in params:
            by_file.setdefault(located[name][0], []).append(name)
    dev = torch.device(device)
    open_device = str(dev) if dev.type == "cuda" else "cpu"
    with torch.no_grad():
        for f, names in by_file.items():
            with safe_open(f, framework="pt", device=open_device) as sf:
                for name in names:
                    pname, start, shape = layout[name]
                    params[pname][start : start + shape[0]].copy_(sf.get_tensor(name))
    model.eval()
    model.requires_grad_(False)
    return model


def random_model(
    cfg: ModelConfig, device: torch.device | str, dtype: torch.dtype, seed: int = 0, std: float = 0.02
) -> DecoderLM:
    """A ``DecoderLM`` of ``cfg``'s real shapes with N(0, std) weights, made directly on ``device``.

    For benchmarks (e.g. Llama-2-7B shapes on a GPU): no checkpoint, no CPU copy. Norm weights are
    the identity scale (1, or 0 for Gemma's ``1 + weight``) and biases 0; the same seed on the same device gives the same weights. Fused parameters
    (``qkv_proj``, ``gate_up_proj``) are drawn whole, in their fused shapes.
    """
    with torch.device("meta"):
        model = DecoderLM(cfg, dtype=dtype)
    model.to_empty(device=device)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    gen = torch.Generator(device=torch.device(device)).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(0.0 if cfg.arch.gemma_norms else 1.0)  # Gemma scales by 1 + weight
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, std, generator=gen)
    model.eval()
    model.requires_grad_(False)
    return model
