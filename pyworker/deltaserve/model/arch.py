"""The architecture table and the resolved model configuration.

Everything that differs between the supported decoder families lives here, as data:

- ``ArchSpec``    one row of ``ARCH_TABLE``: what a family changes (biases, sliding window, the
                  names of its adaptable linears). The decoder reads nothing else about families.
- ``ARCH_TABLE``  HF ``architectures[0]`` name -> ``ArchSpec``.
- ``ModelConfig`` one model's ``config.json`` (+ ``generation_config.json``) resolved into the
                  fields the decoder, the KV cache and the loader need. Both the classic
                  (``rope_theta`` + ``rope_scaling``) and the transformers-5 (``rope_parameters``)
                  spellings are accepted. Anything we do not implement is refused with a
                  ``ValueError`` that names the field, never silently approximated.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The seven linears of a Llama-family block, in HF names. Adapter targets (LoRA, deltas) are
# derived from this tuple, never from per-architecture code.
LLAMA_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ArchSpec:
    """What one decoder family changes relative to plain Llama."""

    name: str
    """HF class name as written in ``config.json`` ``architectures[0]``."""
    qkv_bias: bool
    """q/k/v projections always carry a bias (Qwen2), independent of ``config.json``."""
    attention_bias_key: str | None
    """``config.json`` key that, when true, puts a bias on q/k/v *and* o (Llama's ``attention_bias``)."""
    mlp_bias_key: str | None
    """``config.json`` key that, when true, puts a bias on gate/up/down (Llama's ``mlp_bias``)."""
    sliding_window_key: str | None
    """``config.json`` key holding the sliding-window width, or None if the family has none."""
    sliding_window_enable_key: str | None
    """Key that must also be true for the window to apply (Qwen2's ``use_sliding_window``)."""
    linear_names: tuple[str, ...] = LLAMA_LINEARS
    """Names of the adaptable linears in each block (``self_attn.*`` then ``mlp.*``)."""


ARCH_TABLE: dict[str, ArchSpec] = {
    "LlamaForCausalLM": ArchSpec(
        name="LlamaForCausalLM",
        qkv_bias=False,
        attention_bias_key="attention_bias",
        mlp_bias_key="mlp_bias",
        sliding_window_key=None,
        sliding_window_enable_key=None,
    ),
    "MistralForCausalLM": ArchSpec(
        name="MistralForCausalLM",
        qkv_bias=False,
        attention_bias_key=None,
        mlp_bias_key=None,
        sliding_window_key="sliding_window",
        sliding_window_enable_key=None,
    ),
    "Qwen2ForCausalLM": ArchSpec(
        name="Qwen2ForCausalLM",
        qkv_bias=True,
        attention_bias_key=None,
        mlp_bias_key=None,
        sliding_window_key="sliding_window",
        sliding_window_enable_key="use_sliding_window",
    ),
}

SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")


@dataclass(frozen=True)
class ModelConfig:
    """One model's shape and numerics, resolved from its HF directory."""

    architecture: str
    """Key into ``ARCH_TABLE``."""
    vocab_size: int
    """Rows of ``embed_tokens`` / ``lm_head``; logits width."""
    hidden_size: int
    """Residual stream width."""
    intermediate_size: int
    """MLP inner width (gate/up output)."""
    num_layers: int
    """Decoder blocks; also the KV cache's leading dimension."""
    num_heads: int
    """Query heads."""
    num_kv_heads: int
    """Key/value heads (< num_heads means GQA); sizes the KV cache."""
    head_dim: int
    """Per-head width (``head_dim`` in config.json, else hidden_size // num_heads)."""
    rms_norm_eps: float
    """Epsilon inside every RMSNorm."""
    rope_theta: float
    """RoPE base."""
    rope_scaling: dict[str, Any] | None = field(hash=False)
    """None for plain RoPE, else ``{"rope_type": "llama3"|"linear", ...}`` with its parameters."""
    max_position_embeddings: int
    """Longest context the model was configured for; the default ``max_model_len``."""
    tie_word_embeddings: bool
    """lm_head shares ``embed_tokens.weight``."""
    qkv_bias: bool
    """q/k/v projections have a bias (Qwen2, or Llama with ``attention_bias``)."""
    o_bias: bool = False
    """o_proj has a bias (Llama with ``attention_bias``)."""
    mlp_bias: bool = False
    """gate/up/down have a bias (Llama with ``mlp_bias``)."""
    sliding_window: int | None = None
    """Keys further back than this many positions are masked (Mistral); None = full causal."""
    eos_token_ids: list[int] = field(default_factory=list, hash=False)
    """Token ids that end generation (generation_config.json wins over config.json)."""
    bos_token_id: int | None = None
    """Token prepended by the tokenizer, if any."""
    torch_dtype: str | None = None
    """Checkpoint dtype name (``"bfloat16"``...); the loader's default on CUDA."""

    @property
    def arch(self) -> ArchSpec:
        return ARCH_TABLE[self.architecture]

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_model_dir(cls, path: str | Path) -> ModelConfig:
        """Read ``config.json`` (+ ``generation_config.json`` if present) from an HF directory."""
        path = Path(path)
        cfg_path = path / "config.json"
        if not cfg_path.is_file():
            raise ValueError(f"{path}: no config.json (expected an HF model directory)")
        raw = json.loads(cfg_path.read_text())
        gen = None
        gen_path = path / "generation_config.json"
        if gen_path.is_file():
            gen = json.loads(gen_path.read_text())
        return cls.from_dict(raw, generation_config=gen, source=str(cfg_path))

    @classmethod
    def from_dict(
        cls,
        raw: dict[str, Any],
        generation_config: dict[str, Any] | None = None,
        source: str = "config.json",
    ) -> ModelConfig:
        """Resolve a parsed ``config.json`` dict; ``source`` prefixes error messages."""

        def need(key: str) -> Any:
            if raw.get(key) is None:
                raise ValueError(f"{source}: missing required field '{key}'")
            return raw[key]

        archs = raw.get("architectures") or []
        if not archs:
            raise ValueError(f"{source}: field 'architectures' is missing or empty")
        arch_name = archs[0]
        if arch_name not in ARCH_TABLE:
            raise ValueError(
                f"{source}: unsupported architecture '{arch_name}' in field 'architectures'; "
                f"supported: {sorted(ARCH_TABLE)}"
            )
        spec = ARCH_TABLE[arch_name]

        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{source}: unsupported 'hidden_act' {act!r} (only 'silu')")

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        if heads % kv_heads != 0:
            raise ValueError(
                f"{source}: 'num_attention_heads' ({heads}) is not a multiple of 'num_key_value_heads' ({kv_heads})"
            )
        head_dim = raw.get("head_dim") or hidden // heads

        rope_theta, rope_scaling = _resolve_rope(raw, source)

        sliding = None
        if spec.sliding_window_key is not None:
            enabled = True
            if spec.sliding_window_enable_key is not None:
                enabled = bool(raw.get(spec.sliding_window_enable_key, False))
            window = raw.get(spec.sliding_window_key)
            if enabled and window is not None:
                if spec.sliding_window_enable_key is not None:
                    # Qwen2 applies the window to only some layers (max_window_layers); we do not
                    # model per-layer windows.
                    raise ValueError(
                        f"{source}: '{spec.sliding_window_enable_key}': true is not supported "
                        f"for {arch_name} (per-layer sliding windows)"
                    )
                sliding = int(window)

        eos: Any = None
        if generation_config is not None:
            eos = generation_config.get("eos_token_id")
        if eos is None:
            eos = raw.get("eos_token_id")
        eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
        bos = raw.get("bos_token_id")
        if bos is None and generation_config is not None:
            bos = generation_config.get("bos_token_id")

        def flag(key: str | None) -> bool:
            return bool(raw.get(key, False)) if key is not None else False

        attn_bias = flag(spec.attention_bias_key)
        return cls(
            architecture=arch_name,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=int(head_dim),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings") or 2048),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=spec.qkv_bias or attn_bias,
            o_bias=attn_bias,
            mlp_bias=flag(spec.mlp_bias_key),
            sliding_window=sliding,
            eos_token_ids=eos_ids,
            bos_token_id=None if bos is None else int(bos),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
        )


def _resolve_rope(raw: dict[str, Any], source: str) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either ``rope_parameters`` (transformers 5) or the classic keys."""
    params = raw.get("rope_parameters")
    scaling: dict[str, Any] | None
    if params is not None:
        field_name = "rope_parameters"
        if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
            raise ValueError(f"{source}: per-layer-type 'rope_parameters' are not supported")
        scaling = dict(params)
        theta = scaling.pop("rope_theta", raw.get("rope_theta", 10000.0))
    else:
        field_name = "rope_scaling"
        theta = raw.get("rope_theta", 10000.0)
        scaling = dict(raw["rope_scaling"]) if raw.get("rope_scaling") else None
    if scaling is None:
        return float(theta), None
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"{source}: unsupported rope type {rope_type!r} in field '{field_name}'; "
            f"supported: {list(SUPPORTED_ROPE_TYPES)}"
        )
    partial = scaling.pop("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1.0, 1):
        raise ValueError(f"{source}: 'partial_rotary_factor' {partial} is not supported (only 1.0)")
    if rope_type == "default":
        return float(theta), None
    required = {
        "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
        "linear": ("factor",),
    }[rope_type]
    for key in required:
        if scaling.get(key) is None:
            raise ValueError(f"{source}: '{field_name}' of type {rope_type!r} lacks '{key}'")
    resolved: dict[str, Any] = {"rope_type": rope_type}
    for key in required:
        resolved[key] = scaling[key]
    return float(theta), resolved
