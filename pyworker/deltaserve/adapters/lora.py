"""PEFT LoRA adapters: read one directory, validate it against the base, hold its tensors.

Format (what ``peft``'s ``save_pretrained`` writes for a ``LoraConfig``)::

    <adapter_dir>/adapter_config.json        LoraConfig as JSON: peft_type "LORA", r, lora_alpha,
                                             use_rslora, target_modules, rank_pattern, alpha_pattern,
                                             layers_to_transform, ...
    <adapter_dir>/adapter_model.safetensors  one pair per adapted projection of each layer:
        base_model.model.model.layers.{i}.self_attn.{q,k,v,o}_proj.lora_A.weight   [r, in]
        base_model.model.model.layers.{i}.mlp.{gate,up,down}_proj.lora_B.weight    [out, r]

Semantics (identical to PEFT's ``lora.Linear`` with dropout off)::

    y = x @ W.T + scaling * (x @ A.T) @ B.T
    scaling = alpha / r            (alpha / sqrt(r) when use_rslora)
    r, alpha per module = rank_pattern / alpha_pattern entry matching the module name
                          (PEFT's rule: first key k with re.match(rf"(.*\\.)?({k})$", name)),
                          else the config's r / lora_alpha

Accepted: any subset of the base's adaptable linears (``ArchSpec.linear_names``: q, k, v, o, gate,
up, down) chosen by ``target_modules`` as a list (PEFT's suffix match), the string "all-linear", or
a regex string (``re.fullmatch`` against HF module names such as
``model.layers.3.self_attn.q_proj``); ``exclude_modules``; ``layers_to_transform`` (+
``layers_pattern``); ranks 1..256, different per module via ``rank_pattern``; float16, bfloat16 or
float32 tensors.
Every regex-valued field runs on a linear-time engine (``peft_regex``): a pattern Python's ``re``
would backtrack on forever is matched in linear time, and one that engine refuses (look-around,
back-references) is refused like any other bad field.

Refused, with a ``LoraAdapterError`` (a ``ValueError``) naming the adapter dir and the offending
field or tensor; a refused adapter is never half-loaded:

- missing ``adapter_config.json`` / ``adapter_model.safetensors``; a pickle ``adapter_model.bin``
  alone (never unpickled: loading pickle executes arbitrary code);
- ``peft_type`` other than "LORA"; variants whose forward is not ``scaling * B @ A``: ``use_dora``,
  ``lora_bias``, ``use_qalora``, ``alora_invocation_tokens``, ``use_bdlora``, ``arrow_config``,
  ``kasa_config``, ``monteclora_config``, ``target_parameters``, ``layer_replication``,
  ``trainable_token_indices``; ``modules_to_save`` (whole replaced modules, not a low-rank delta);
  ``bias`` other than "none" (trained biases are not part of the delta we apply);
  ``fan_in_fan_out: true`` (Conv1D-style ``[in, out]`` weights of GPT-2-like models: not a
  Llama-family layout, so the adapter was made for another architecture);
- targets outside the base's adaptable linears (``embed_tokens``, ``lm_head``, anything else), in
  ``target_modules`` or as tensors; tensors of layers >= the base's ``num_layers``; tensors that
  the config does not target, or targeted modules without tensors; an A without its B;
- since ``base_model_name_or_path`` cannot be resolved offline, shapes stand for the architecture:
  every ``A [r, in]`` / ``B [out, r]`` is checked against the base projection's in/out features and
  the module's configured rank (the message names the tensor and both shapes);
- rank outside 1..256; dtypes other than float16/bfloat16/float32; non-finite values (also after a
  requested ``dtype`` cast).

``lora_delta_ref`` and ``merged_weight`` are the pure-torch references the kernels, the serving path
and the reference models in tests are checked against.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..model.arch import ModelConfig
from ..model.decoder import linear_slots
from .peft_regex import fullmatches, layer_pattern_matches, pattern_keys

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PICKLE_WEIGHTS_NAME = "adapter_model.bin"
MIN_RANK = 1
MAX_RANK = 256
ALLOWED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# safetensors dtype names of the torch dtypes a header may hold (anything else is shown by name).
_SAFETENSORS_DTYPE = {
    "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
    "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
    "BOOL": torch.bool,
}  # fmt: skip
_SAFETENSORS_NAME = {torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32"}

# HF module path of each adaptable linear inside a decoder block (``<parent>.<name>``).
# (Phi-3's checkpoints and PEFT adapters name the fused qkv_proj / gate_up_proj themselves.)
_PARENT = {
    "q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
    "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp", "qkv_proj": "self_attn", "gate_up_proj": "mlp",
}  # fmt: skip

# Fields whose presence (truthy) changes the forward away from ``x @ W.T + s * x @ A.T @ B.T``.
_UNSUPPORTED_FLAGS = {
    "use_dora": "DoRA rescales the merged weight by a learned magnitude vector, not a plain low-rank delta",
    "lora_bias": "LoRA-B biases are not applied by the low-rank kernels",
    "use_qalora": "QA-LoRA pools the input in groups before A",
    "alora_invocation_tokens": "activated LoRA applies the delta only after invocation tokens",
    "use_bdlora": "block-diagonal LoRA factors are stored in a sharded layout",
    "arrow_config": "Arrow routes between several adapters per token",
    "kasa_config": "KaSA modifies the base weight (SVD truncation)",
    "monteclora_config": "MonteCLoRA samples the adapter weights",
    "target_parameters": "LoRA on raw parameters (MoE experts) is not a linear-module adapter",
    "layer_replication": "replicated layers change the base model's depth",
    "trainable_token_indices": "trainable tokens modify the embedding matrix",
    "modules_to_save": "modules_to_save replaces whole modules (often embed_tokens/lm_head), not a low-rank delta",
}

# <optional PEFT prefix> layers.<i>.<parent>.<proj>.lora_<A|B>.weight
_TENSOR_RE = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?layers\.(?P<layer>\d+)\.(?P<parent>self_attn|mlp)\."
    r"(?P<proj>[A-Za-z0-9_]+)\.lora_(?P<ab>[AB])\.weight$"
)
# Module names outside the blocks that a regex ``target_modules`` must not reach.
_NON_BLOCK_MODULES = ("lm_head", "model.embed_tokens")


class LoraAdapterError(ValueError):
    """An adapter directory that cannot be served; the message names the dir and the field/tensor."""


@dataclass(frozen=True, eq=False)
class LoraWeights:
    """The LoRA factors of one projection of one layer."""

    a: torch.Tensor
    """``lora_A`` ``[rank, in_features]``: the shrink, applied first."""
    b: torch.Tensor
    """``lora_B`` ``[out_features, rank]``: the expand."""
    rank: int
    """This module's r (``rank_pattern`` entry or the config's ``r``); equals ``a.shape[0]``."""
    alpha: float
    """This module's lora_alpha (``alpha_pattern`` entry or the config's ``lora_alpha``)."""
    scaling: float
    """Multiplier of ``B @ A``: ``alpha / rank``, or ``alpha / sqrt(rank)`` with rsLoRA."""


@dataclass(frozen=True, eq=False)
class LoraSite:
    """Where one adapted projection of one layer is in the weights file, and its factors' scalars."""

    a_key: str
    """Tensor name of its ``lora_A`` ``[rank, in_features]``."""
    b_key: str
    """Tensor name of its ``lora_B`` ``[out_features, rank]``."""
    rank: int
    """This module's r (``rank_pattern`` entry or the config's ``r``)."""
    alpha: float
    """This module's lora_alpha (``alpha_pattern`` entry or the config's ``lora_alpha``)."""
    scaling: float
    """Multiplier of ``B @ A``: ``alpha / rank``, or ``alpha / sqrt(rank)`` with rsLoRA."""


@dataclass(frozen=True, eq=False, kw_only=True)
class LoraSpec:
    """A PEFT LoRA directory validated against the base from its config and the weights file's
    header alone (``read_lora_spec``): every check of the module docstring but the values'."""

    path: Path
    """The adapter directory (error messages and registry listings name it)."""
    weights_path: Path
    """Its ``adapter_model.safetensors``."""
    rank: int
    """Config ``r``: the default rank of modules without a ``rank_pattern`` entry."""
    alpha: float
    """Config ``lora_alpha``: the default alpha of modules without an ``alpha_pattern`` entry."""
    use_rslora: bool
    """Scaling is ``alpha / sqrt(r)`` instead of ``alpha / r``."""
    rank_pattern: dict[str, int]
    """Per-module rank overrides as written by PEFT (key: module-name suffix regex)."""
    alpha_pattern: dict[str, float]
    """Per-module alpha overrides as written by PEFT."""
    sites: dict[tuple[int, str], LoraSite] = field(hash=False)
    """(layer index, HF projection name) -> its tensors and scalars; absent pairs are not adapted."""
    stored_dtypes: frozenset[torch.dtype]
    """dtypes of the A/B tensors in the file."""
    num_layers: int
    """The base's decoder block count the adapter was validated against."""
    features: dict[str, tuple[int, int]] = field(hash=False)
    """Base projection name -> (in_features, out_features), for every adaptable linear."""
    base_model_name_or_path: str | None = None
    """What the adapter says it was trained on (informational: not resolvable offline)."""

    @property
    def target_modules(self) -> frozenset[str]:
        """HF projection names adapted in at least one layer (subset of the base's linear names)."""
        return frozenset(proj for _, proj in self.sites)

    @property
    def layers(self) -> list[int]:
        """Sorted indices of layers with at least one adapted projection."""
        return sorted({layer for layer, _ in self.sites})

    @property
    def max_rank(self) -> int:
        """Largest rank over all modules (what a padded kernel would need)."""
        return max(s.rank for s in self.sites.values())

    def fail(self, msg: str) -> LoraAdapterError:
        """The error for ``msg`` about this adapter (names its directory)."""
        return LoraAdapterError(f"LoRA adapter {self.path}: {msg}")

    def read_into(self, copies: Sequence[TensorCopy], out: torch.Tensor | None, dtype: torch.dtype) -> None:
        """Copies tensors of the weights file into ``out`` (a contiguous CPU tensor of ``dtype``) as
        ``deltaserve._native.read_safetensors_into`` says, without the GIL: values checked finite,
        in the file and in ``dtype``. ``out`` None checks and writes nothing. LoraAdapterError
        naming the tensor when a value is not finite or the file changed since ``read_lora_spec``."""
        from .._native import read_safetensors_into

        if out is not None and (out.device.type != "cpu" or not out.is_contiguous() or out.dtype != dtype):
            raise ValueError(f"read_into needs a contiguous CPU tensor of {dtype}, got {out.dtype} on {out.device}")
        ptr, nbytes = (0, 0) if out is None else (out.data_ptr(), out.numel() * out.element_size())
        try:
            read_safetensors_into(self.weights_path, copies, _SAFETENSORS_NAME[dtype], ptr, nbytes)
        except OSError as e:
            raise self.fail(f"{WEIGHTS_NAME} cannot be read: {e}") from None
        except ValueError as e:
            raise self.fail(str(e)) from None


TensorCopy = tuple[str, int, int, int, bool]
"""``(name, rows, cols, dst_offset, transpose)``: one tensor of ``LoraSpec.read_into``."""


@dataclass(frozen=True, eq=False, kw_only=True)
class LoraAdapter(LoraSpec):
    """One validated PEFT LoRA adapter, tensors on CPU, indexed by (layer, HF projection name)."""

    modules: dict[tuple[int, str], LoraWeights] = field(hash=False)
    """(layer index, HF projection name) -> factors; absent pairs are not adapted."""
    dtype: torch.dtype
    """dtype of every A and B tensor."""

    def get(self, layer: int, proj: str) -> LoraWeights | None:
        """The factors of ``proj`` in ``layer``, or None if that projection is not adapted there."""
        self._check_site(layer, proj)
        return self.modules.get((layer, proj))

    @property
    def nbytes(self) -> int:
        """Bytes of all A and B tensors (what residency accounting charges for this adapter)."""
        return sum(w.a.nbytes + w.b.nbytes for w in self.modules.values())

    def _check_site(self, layer: int, proj: str) -> None:
        if proj not in self.features:
            raise ValueError(f"unknown projection {proj!r}; the base's are {list(self.features)}")
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} out of range 0..{self.num_layers - 1}")


def projection_features(base: ModelConfig) -> dict[str, tuple[int, int]]:
    """HF projection name -> (in_features, out_features) for every adaptable linear of ``base``."""
    in_features = {
        "q_proj": base.hidden_size, "k_proj": base.hidden_size, "v_proj": base.hidden_size,
        "o_proj": base.q_size, "gate_proj": base.hidden_size, "up_proj": base.hidden_size,
        "down_proj": base.intermediate_size, "qkv_proj": base.hidden_size, "gate_up_proj": base.hidden_size,
    }  # fmt: skip
    return {name: (in_features[name], slot.size) for name, slot in linear_slots(base).items()}


def hf_module_name(layer: int, proj: str) -> str:
    """The HF (and PEFT) module name of ``proj`` in ``layer``: ``model.layers.3.self_attn.q_proj``."""
    return f"model.layers.{layer}.{_PARENT[proj]}.{proj}"


def read_lora_spec(adapter_dir: str | Path, base: ModelConfig) -> LoraSpec:
    """Validate a PEFT LoRA directory against ``base`` from its config and the weights file's header
    (names, shapes, dtypes): everything but the tensors' values, which ``LoraSpec.read_into``
    checks as it reads them. Raises ``LoraAdapterError`` for anything in the module docstring's
    refusal list."""
    path = Path(adapter_dir)
    where = str(path)

    def fail(msg: str) -> LoraAdapterError:
        return LoraAdapterError(f"LoRA adapter {where}: {msg}")

    if not path.is_dir():
        raise fail("not a directory")
    cfg = _read_config(path, fail)
    weights_path = path / WEIGHTS_NAME
    if not weights_path.is_file():
        if (path / PICKLE_WEIGHTS_NAME).is_file():
            raise fail(
                f"only {PICKLE_WEIGHTS_NAME} (pickle) is present; pickle is refused because loading it can "
                f"execute code; re-save the adapter with safetensors (save_pretrained(safe_serialization=True))"
            )
        raise fail(f"missing {WEIGHTS_NAME}")

    # ---- config fields
    peft_type = cfg.get("peft_type")
    if peft_type != "LORA":
        raise fail(f"field 'peft_type' is {peft_type!r}; only 'LORA' adapters are supported")
    for key, why in _UNSUPPORTED_FLAGS.items():
        if cfg.get(key):
            raise fail(f"field '{key}' is set ({cfg[key]!r}): not supported ({why})")
    if cfg.get("fan_in_fan_out"):
        raise fail(
            "field 'fan_in_fan_out' is true: that layout ([in, out] Conv1D weights, GPT-2 style) does not "
            "exist in Llama-family bases, so the adapter was made for another architecture"
        )
    bias = cfg.get("bias", "none")
    if bias != "none":
        raise fail(f"field 'bias' is {bias!r}; only 'none' is supported (trained biases are not applied)")
    use_rslora = cfg.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise fail(f"field 'use_rslora' must be a boolean, got {use_rslora!r}")
    rank = _check_rank(cfg.get("r"), "field 'r'", fail)
    alpha = _check_alpha(cfg.get("lora_alpha"), "field 'lora_alpha'", fail)
    rank_pattern = _pattern(cfg, "rank_pattern", fail)
    alpha_pattern = _pattern(cfg, "alpha_pattern", fail)
    rank_pattern = {k: _check_rank(v, f"field 'rank_pattern' entry {k!r}", fail) for k, v in rank_pattern.items()}
    alpha_pattern = {k: _check_alpha(v, f"field 'alpha_pattern' entry {k!r}", fail) for k, v in alpha_pattern.items()}

    names = tuple(base.arch.linear_names)
    features = projection_features(base)
    expected = _targeted_sites(cfg, base, names, fail)

    # ---- tensors, from the header
    header = _read_header(weights_path, fail)
    pairs: dict[tuple[int, str], dict[str, tuple[str, list[int]]]] = {}
    stored: set[torch.dtype] = set()
    for key, (dtype_name, shape) in header.items():
        m = _TENSOR_RE.match(key)
        if m is None:
            raise fail(
                f"tensor '{key}' is not a LoRA factor of a block linear (expected "
                f"'base_model.model.model.layers.<i>.<self_attn|mlp>.<proj>.lora_<A|B>.weight'; "
                f"LoRA on embed_tokens/lm_head or other modules is not supported)"
            )
        layer, proj = int(m["layer"]), m["proj"]
        if proj not in names or _PARENT.get(proj) != m["parent"]:
            raise fail(
                f"tensor '{key}': '{m['parent']}.{proj}' is not one of the base's adaptable linears {list(names)}"
            )
        if layer >= base.num_layers:
            raise fail(f"tensor '{key}': layer {layer} is beyond the base's num_layers={base.num_layers}")
        dtype = _SAFETENSORS_DTYPE.get(dtype_name)
        if dtype not in ALLOWED_DTYPES:
            shown = dtype_name if dtype is None else f"{dtype} ({dtype_name})"
            raise fail(f"tensor '{key}' has dtype {shown}; supported: float16, bfloat16, float32")
        if len(shape) != 2:
            raise fail(f"tensor '{key}' has shape {shape}; expected a 2-D matrix")
        if (layer, proj) not in expected:
            raise fail(f"tensor '{key}': module '{hf_module_name(layer, proj)}' is not targeted by 'target_modules'")
        stored.add(dtype)
        pairs.setdefault((layer, proj), {})[m["ab"]] = (key, shape)

    for site in sorted(expected, key=lambda s: (s[0], names.index(s[1]))):
        if site not in pairs:
            raise fail(
                f"module '{hf_module_name(*site)}' is targeted by 'target_modules' but has no lora_A/lora_B tensors"
            )

    modules = [hf_module_name(layer, proj) for layer, proj in pairs]
    rank_keys = pattern_keys(rank_pattern, modules, "field 'rank_pattern'", fail)
    alpha_keys = pattern_keys(alpha_pattern, modules, "field 'alpha_pattern'", fail)
    sites: dict[tuple[int, str], LoraSite] = {}
    for (layer, proj), ab in sorted(pairs.items(), key=lambda kv: (kv[0][0], names.index(kv[0][1]))):
        module = hf_module_name(layer, proj)
        for which in "AB":
            if which not in ab:
                other = next(iter(ab.values()))[0]
                raise fail(f"tensor '{other}' has no matching lora_{which}")
        (a_key, a_shape), (b_key, b_shape) = ab["A"], ab["B"]
        rank_key, alpha_key = rank_keys[module], alpha_keys[module]
        r = rank if rank_key is None else rank_pattern[rank_key]
        mod_alpha = alpha if alpha_key is None else alpha_pattern[alpha_key]
        fin, fout = features[proj]
        if a_shape != [r, fin]:
            raise fail(
                f"tensor '{a_key}' has shape {a_shape} but the base's {proj} needs lora_A "
                f"[r={r}, in_features={fin}] = {[r, fin]}"
            )
        if b_shape != [fout, r]:
            raise fail(
                f"tensor '{b_key}' has shape {b_shape} but the base's {proj} needs lora_B "
                f"[out_features={fout}, r={r}] = {[fout, r]}"
            )
        scaling = mod_alpha / math.sqrt(r) if use_rslora else mod_alpha / r
        sites[(layer, proj)] = LoraSite(a_key=a_key, b_key=b_key, rank=r, alpha=mod_alpha, scaling=scaling)

    if not sites:
        raise fail(f"{WEIGHTS_NAME} holds no LoRA tensors")
    base_name = cfg.get("base_model_name_or_path")
    return LoraSpec(
        path=path,
        weights_path=weights_path,
        rank=rank,
        alpha=alpha,
        use_rslora=use_rslora,
        rank_pattern=rank_pattern,
        alpha_pattern=alpha_pattern,
        sites=sites,
        stored_dtypes=frozenset(stored),
        num_layers=base.num_layers,
        features=features,
        base_model_name_or_path=None if base_name is None else str(base_name),
    )


def load_lora_adapter(adapter_dir: str | Path, base: ModelConfig, dtype: torch.dtype | None = None) -> LoraAdapter:
    """Read and validate a PEFT LoRA directory against ``base``; tensors land on CPU.

    ``dtype``: cast every A/B to it (float16/bfloat16/float32); None keeps the stored dtype (float32
    when A/B tensors disagree). Raises ``LoraAdapterError`` for anything in the module docstring's
    refusal list.
    """
    if dtype is not None and dtype not in ALLOWED_DTYPES:
        raise LoraAdapterError(
            f"LoRA adapter {adapter_dir}: requested dtype {dtype} is not one of {[str(d) for d in ALLOWED_DTYPES]}"
        )
    spec = read_lora_spec(adapter_dir, base)
    out_dtype = dtype or (next(iter(spec.stored_dtypes)) if len(spec.stored_dtypes) == 1 else torch.float32)
    # Every factor goes into one flat buffer in a single GIL-free read; the weights are views of it.
    flat = torch.empty(sum(s.rank * sum(spec.features[proj]) for (_, proj), s in spec.sites.items()), dtype=out_dtype)
    copies: list[TensorCopy] = []
    modules: dict[tuple[int, str], LoraWeights] = {}
    offset = 0
    for (layer, proj), site in spec.sites.items():
        (fin, fout), r = spec.features[proj], site.rank
        b_at = offset + r * fin
        copies += [(site.a_key, r, fin, offset, False), (site.b_key, fout, r, b_at, False)]
        a, b = flat[offset:b_at].view(r, fin), flat[b_at : b_at + fout * r].view(fout, r)
        modules[(layer, proj)] = LoraWeights(a=a, b=b, rank=r, alpha=site.alpha, scaling=site.scaling)
        offset = b_at + fout * r
    spec.read_into(copies, flat, out_dtype)
    fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(LoraSpec)}
    return LoraAdapter(**fields, modules=modules, dtype=out_dtype)


def lora_delta_ref(adapter: LoraAdapter, layer: int, proj: str, x: torch.Tensor) -> torch.Tensor:
    """What the adapter adds to ``proj``'s output in ``layer``: ``scaling * (x @ A.T) @ B.T``.

    Shape: x ``[..., in_features]`` -> ``[..., out_features]``, in x's dtype (A and B are cast to
    it, as PEFT casts x to the adapter's dtype; for the same dtype the two agree). Zeros when the
    projection is not adapted in that layer.
    """
    adapter._check_site(layer, proj)
    fin, fout = adapter.features[proj]
    if x.shape[-1] != fin:
        raise ValueError(f"{proj}: x has {x.shape[-1]} features, expected {fin}")
    w = adapter.modules.get((layer, proj))
    if w is None:
        return x.new_zeros(*x.shape[:-1], fout)
    a, b = w.a.to(device=x.device, dtype=x.dtype), w.b.to(device=x.device, dtype=x.dtype)
    return ((x @ a.T) @ b.T) * w.scaling


def merged_weight(adapter: LoraAdapter, base_weight: torch.Tensor, layer: int, proj: str) -> torch.Tensor:
    """``W + scaling * B @ A`` for ``proj`` in ``layer`` (``W`` ``[out, in]``), in W's dtype and device.

    The delta is computed in float32 and added to W in float32, then cast back. ``W`` unchanged
    (a copy) when the projection is not adapted there.
    """
    adapter._check_site(layer, proj)
    fin, fout = adapter.features[proj]
    if tuple(base_weight.shape) != (fout, fin):
        raise ValueError(f"{proj}: base weight has shape {list(base_weight.shape)}, expected {[fout, fin]}")
    w = adapter.modules.get((layer, proj))
    if w is None:
        return base_weight.clone()
    delta = (w.b.to(base_weight.device, torch.float32) @ w.a.to(base_weight.device, torch.float32)) * w.scaling
    return (base_weight.float() + delta).to(base_weight.dtype)


# ---------------------------------------------------------------------------------------- helpers


def _read_config(path: Path, fail: Any) -> dict[str, Any]:
    cfg_path = path / CONFIG_NAME
    if not cfg_path.is_file():
        raise fail(f"missing {CONFIG_NAME}")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise fail(f"{CONFIG_NAME} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise fail(f"{CONFIG_NAME} must hold a JSON object")
    return cfg


def _read_header(weights_path: Path, fail: Any) -> dict[str, tuple[str, list[int]]]:
    """Tensor name -> (safetensors dtype name, shape), from the file's header (no data read; the
    native reader, without the GIL and without mapping the file, as the host tier's loader threads
    call it while steps are launched)."""
    from .._native import read_safetensors_header

    try:
        return read_safetensors_header(weights_path)
    except (OSError, ValueError) as e:
        raise fail(f"{WEIGHTS_NAME} cannot be read: {e}") from None


def _check_rank(value: Any, what: str, fail: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise fail(f"{what} must be an integer rank, got {value!r}")
    if not MIN_RANK <= value <= MAX_RANK:
        raise fail(f"{what} is {value}; supported ranks are {MIN_RANK}..{MAX_RANK}")
    return value


def _check_alpha(value: Any, what: str, fail: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise fail(f"{what} must be a finite number, got {value!r}")
    return float(value)


def _pattern(cfg: dict[str, Any], key: str, fail: Any) -> dict[str, Any]:
    value = cfg.get(key) or {}
    if not isinstance(value, dict):
        raise fail(f"field '{key}' must be an object mapping module patterns to values, got {value!r}")
    return value


def _targeted_sites(cfg: dict[str, Any], base: ModelConfig, names: tuple[str, ...], fail: Any) -> set[tuple[int, str]]:
    """(layer, proj) pairs PEFT would adapt on ``base`` given target_modules / exclude / layer filters."""
    targets = cfg.get("target_modules")
    sites = [(layer, proj) for layer in range(base.num_layers) for proj in names]
    module = {site: hf_module_name(*site) for site in sites}

    if targets is None:
        raise fail("field 'target_modules' is missing (PEFT's per-architecture defaults are not resolved here)")
    if isinstance(targets, str):
        if targets == "all-linear":
            # PEFT: every nn.Linear except the output layer; in a Llama block that is all seven.
            chosen = set(sites)
        else:
            hits = fullmatches(targets, [*_NON_BLOCK_MODULES, *module.values()], "field 'target_modules'", fail)
            for outside, matched in zip(_NON_BLOCK_MODULES, hits, strict=False):
                if matched:
                    raise fail(f"field 'target_modules' regex matches '{outside}': LoRA there is not supported")
            chosen = {s for s, matched in zip(module, hits[len(_NON_BLOCK_MODULES) :], strict=True) if matched}
            if not chosen:
                raise fail("field 'target_modules' regex matches none of the base's linears")
    elif isinstance(targets, list) and all(isinstance(t, str) for t in targets):
        if not targets:
            raise fail("field 'target_modules' is empty")
        chosen = set()
        for t in targets:
            hit = {s for s in sites if module[s] == t or module[s].endswith(f".{t}")}
            if not hit:
                raise fail(
                    f"field 'target_modules' entry {t!r} names none of the base's adaptable linears "
                    f"{list(names)} in layers 0..{base.num_layers - 1} (LoRA on embed_tokens, lm_head or "
                    f"other modules is not supported)"
                )
            chosen |= hit
        chosen = _filter_layers(cfg, base, chosen, module, fail)
    else:
        raise fail(f"field 'target_modules' must be a list of names or a string, got {targets!r}")

    exclude = cfg.get("exclude_modules")
    if exclude:
        if isinstance(exclude, str):
            hits = fullmatches(exclude, list(module.values()), "field 'exclude_modules'", fail)
            chosen -= {s for s, hit in zip(module, hits, strict=True) if hit}
        elif isinstance(exclude, list) and all(isinstance(e, str) for e in exclude):
            chosen = {s for s in chosen if not any(module[s] == e or module[s].endswith(f".{e}") for e in exclude)}
        else:
            raise fail("field 'exclude_modules' must be a list of names or a string")
    if not chosen:
        raise fail("fields 'target_modules' / 'layers_to_transform' / 'exclude_modules' select no module of the base")
    return chosen


def _filter_layers(
    cfg: dict[str, Any], base: ModelConfig, chosen: set[tuple[int, str]], module: dict[tuple[int, str], str], fail: Any
) -> set[tuple[int, str]]:
    """Apply ``layers_to_transform`` (PEFT applies it to list targets only, as here)."""
    layers = cfg.get("layers_to_transform")
    if layers is None or layers == []:
        return chosen
    if isinstance(layers, int) and not isinstance(layers, bool):
        layers = [layers]
    if not isinstance(layers, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in layers):
        raise fail(f"field 'layers_to_transform' must be an integer or a list of integers, got {layers!r}")
    beyond = [i for i in layers if not 0 <= i < base.num_layers]
    if beyond:
        raise fail(f"field 'layers_to_transform' names layers {beyond} beyond the base's num_layers={base.num_layers}")
    pattern = cfg.get("layers_pattern")
    if pattern:
        if not isinstance(pattern, (str, list)):
            raise fail("field 'layers_pattern' must be a string or a list of strings")
        pats = [pattern] if isinstance(pattern, str) else pattern
        probe = ["model.layers.0.self_attn.q_proj"]
        if not any(layer_pattern_matches(p, probe, "field 'layers_pattern'", fail)[0] for p in pats):
            raise fail("field 'layers_pattern' does not match the base's 'model.layers.<i>' naming")
    return {s for s in chosen if s[0] in layers}
