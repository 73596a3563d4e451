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
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The seven linears of a Llama-family block, in HF names. Adapter targets (LoRA, deltas) are
# derived from this tuple, never from per-architecture code.
LLAMA_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


PHI3_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
"""Phi-3's checkpoint (and its PEFT adapters) hold q|k|v and gate|up already fused."""


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
    """Names of the adaptable linears in each block (``self_attn.*`` then ``mlp.*``): the checkpoint's
    and PEFT's module names (Phi-3: ``PHI3_LINEARS``, fused in the checkpoint)."""
    window_layers: str = "all"
    """Which layers the window applies to when ``config.json`` has no ``layer_types``: ``"all"``
    (Mistral, Phi-3), ``"from_max_window_layers"`` (Qwen2/3: layers >= ``max_window_layers``),
    ``"alternate"`` (Gemma 2: even layers), ``"pattern"`` (Gemma 3: all but every
    ``sliding_window_pattern``-th layer)."""
    qk_norm: bool = False
    """RMSNorm over each head of q and of k before RoPE (Qwen3, Gemma 3)."""
    gemma_norms: bool = False
    """RMSNorm scales by ``1 + weight`` in float32, rounding once at the end (Gemma)."""
    sandwich_norms: bool = False
    """Norms after attention and around the MLP (Gemma 2/3: ``post_attention_layernorm`` normalises the
    attention output; ``pre_feedforward_layernorm`` / ``post_feedforward_layernorm`` wrap the MLP)."""
    scale_embeddings: bool = False
    """Embeddings are multiplied by ``sqrt(hidden_size)`` (rounded to the model dtype) (Gemma)."""
    act_keys: tuple[str, ...] = ("hidden_act",)
    """``config.json`` keys naming the MLP activation, first present wins."""
    softcap_keys: tuple[str, ...] = ()
    """Soft-capping fields read (``attn_logit_softcapping``, ``final_logit_softcapping``)."""
    query_pre_attn_scalar: bool = False
    """Attention scale is ``query_pre_attn_scalar ** -0.5`` instead of ``head_dim ** -0.5`` (Gemma)."""
    local_rope: bool = False
    """Sliding-window layers have their own RoPE (Gemma 3's ``rope_local_base_freq``)."""


def _arch(name: str, **kw: Any) -> ArchSpec:
    base: dict[str, Any] = dict(
        qkv_bias=False,
        attention_bias_key=None,
        mlp_bias_key=None,
        sliding_window_key=None,
        sliding_window_enable_key=None,
    )
    base.update(kw)
    return ArchSpec(name=name, **base)


_GEMMA = dict(
    attention_bias_key="attention_bias",
    sliding_window_key="sliding_window",
    gemma_norms=True,
    sandwich_norms=True,
    scale_embeddings=True,
    act_keys=("hidden_activation", "hidden_act"),
    query_pre_attn_scalar=True,
)

ARCH_TABLE: dict[str, ArchSpec] = {
    spec.name: spec
    for spec in (
        _arch("LlamaForCausalLM", attention_bias_key="attention_bias", mlp_bias_key="mlp_bias"),
        _arch("MistralForCausalLM", sliding_window_key="sliding_window"),
        _arch(
            "Qwen2ForCausalLM",
            qkv_bias=True,
            sliding_window_key="sliding_window",
            sliding_window_enable_key="use_sliding_window",
            window_layers="from_max_window_layers",
        ),
        _arch(
            "Qwen3ForCausalLM",
            attention_bias_key="attention_bias",
            sliding_window_key="sliding_window",
            sliding_window_enable_key="use_sliding_window",
            window_layers="from_max_window_layers",
            qk_norm=True,
        ),
        _arch(
            "Gemma2ForCausalLM",
            window_layers="alternate",
            softcap_keys=("attn_logit_softcapping", "final_logit_softcapping"),
            **_GEMMA,
        ),
        # transformers' Gemma 3 passes no soft-cap to attention (attn_logit_softcapping is unused).
        _arch(
            "Gemma3ForCausalLM",
            window_layers="pattern",
            qk_norm=True,
            local_rope=True,
            softcap_keys=("final_logit_softcapping",),
            **_GEMMA,
        ),
        _arch("Phi3ForCausalLM", sliding_window_key="sliding_window", linear_names=PHI3_LINEARS),
    )
}

SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
"""MLP activations: SwiGLU's silu, GeGLU's tanh-approximated gelu (Gemma)."""
QUANTIZATION_KEYS = ("quantization_config", "compression_config")
"""``config.json`` fields of quantized checkpoints (FP8, AWQ, GPTQ, bitsandbytes, compressed-tensors)."""
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear", "longrope")
"""RoPE scalings; ``su`` is LongRoPE's older name (Phi-3)."""
_LAYER_TYPES = ("full_attention", "sliding_attention")


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
    """RoPE base (of the full-attention layers when ``local_rope_theta`` is set)."""
    rope_scaling: dict[str, Any] | None = field(hash=False)
    """None for plain RoPE, else ``{"rope_type": "llama3"|"linear"|"longrope", ...}`` with its parameters."""
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
    """Window width: keys further back than this many positions are masked in the windowed layers
    (all layers unless ``layer_windows`` says otherwise); None = full causal everywhere."""
    eos_token_ids: list[int] = field(default_factory=list, hash=False)
    """Token ids that end generation (generation_config.json wins over config.json)."""
    bos_token_id: int | None = None
    """Token prepended by the tokenizer, if any."""
    torch_dtype: str | None = None
    """Checkpoint dtype name (``"bfloat16"``...); the loader's default on CUDA."""
    layer_windows: tuple[int | None, ...] | None = None
    """Per-layer window (None: full attention in that layer); None means ``sliding_window`` everywhere."""
    hidden_act: str = "silu"
    """MLP activation (``SUPPORTED_ACTIVATIONS``)."""
    attn_scale: float | None = None
    """Softmax scale of q.k; None means ``head_dim ** -0.5``."""
    attn_softcap: float | None = None
    """Attention scores become ``cap * tanh(score / cap)`` before the mask (Gemma 2)."""
    final_softcap: float | None = None
    """Logits become ``cap * tanh(logits / cap)`` (Gemma 2/3)."""
    local_rope_theta: float | None = None
    """RoPE base of the sliding-window layers (Gemma 3); None: every layer uses ``rope_theta``."""
    local_rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    """RoPE scaling of the sliding-window layers (with ``local_rope_theta``)."""
    generation_defaults: dict[str, Any] = field(default_factory=dict, hash=False)
    """Sampling defaults of ``generation_config.json`` (``temperature``, ``top_p``, ``top_k``, ...)."""

    @property
    def arch(self) -> ArchSpec:
        return ARCH_TABLE[self.architecture]

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def scale(self) -> float:
        """The attention softmax scale."""
        return self.attn_scale if self.attn_scale is not None else self.head_dim**-0.5

    def window_of(self, layer: int) -> int | None:
        """Sliding window of ``layer`` (None: full causal attention)."""
        if self.layer_windows is None:
            return self.sliding_window
        return self.layer_windows[layer]

    def uses_local_rope(self, layer: int) -> bool:
        """Whether ``layer`` takes the local (sliding-layer) RoPE table."""
        return self.local_rope_theta is not None and self.window_of(layer) is not None

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

        for key in QUANTIZATION_KEYS:
            if raw.get(key):
                method = raw[key].get("quant_method") if isinstance(raw[key], dict) else None
                raise ValueError(
                    f"{source}: field '{key}' is set"
                    + (f" (quant_method {method!r})" if method else "")
                    + ": quantized checkpoints (FP8, AWQ, GPTQ, bitsandbytes...) are not supported; "
                    "serve the unquantized (float16 / bfloat16) checkpoint"
                )
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

        act_key = next((k for k in spec.act_keys if raw.get(k) is not None), spec.act_keys[0])
        act = raw.get(act_key) or "silu"
        if act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(f"{source}: unsupported '{act_key}' {act!r} (supported: {list(SUPPORTED_ACTIVATIONS)})")

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        if heads % kv_heads != 0:
            raise ValueError(
                f"{source}: 'num_attention_heads' ({heads}) is not a multiple of 'num_key_value_heads' ({kv_heads})"
            )
        head_dim = int(raw.get("head_dim") or hidden // heads)
        num_layers = int(need("num_hidden_layers"))

        local_theta: float | None = None
        local_scaling: dict[str, Any] | None = None
        params = raw.get("rope_parameters")
        if isinstance(params, dict) and any(isinstance(v, dict) for v in params.values()):
            # Per-layer-type RoPE (transformers 5's spelling for Gemma 3).
            unknown = set(params) - set(_LAYER_TYPES)
            if not spec.local_rope or unknown:
                raise ValueError(f"{source}: per-layer-type 'rope_parameters' are not supported for {arch_name}")
            rope_theta, rope_scaling = _resolve_rope(raw, params.get("full_attention") or {}, head_dim, source)
            local_theta, local_scaling = _resolve_rope(raw, params.get("sliding_attention") or {}, head_dim, source)
        else:
            rope_theta, rope_scaling = _resolve_rope(raw, params, head_dim, source)
            if spec.local_rope:
                local_theta = float(raw.get("rope_local_base_freq", 10000.0))

        sliding, layer_windows = _resolve_windows(raw, spec, num_layers, source)

        eos: Any = None
        if generation_config is not None:
            eos = generation_config.get("eos_token_id")
        if eos is None:
            eos = raw.get("eos_token_id")
        eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
        bos = raw.get("bos_token_id")
        if bos is None and generation_config is not None:
            bos = generation_config.get("bos_token_id")
        defaults = {
            k: generation_config[k]
            for k in ("do_sample", "temperature", "top_p", "top_k", "repetition_penalty", "max_new_tokens")
            if generation_config is not None and generation_config.get(k) is not None
        }

        def flag(key: str | None) -> bool:
            return bool(raw.get(key, False)) if key is not None else False

        def softcap(key: str) -> float | None:
            value = raw.get(key) if key in spec.softcap_keys else None
            if value is not None and float(value) <= 0:
                raise ValueError(f"{source}: '{key}' must be positive or null, got {value!r}")
            return None if value is None else float(value)

        attn_scale = None
        if spec.query_pre_attn_scalar:
            attn_scale = float(raw.get("query_pre_attn_scalar") or head_dim) ** -0.5

        attn_bias = flag(spec.attention_bias_key)
        return cls(
            architecture=arch_name,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
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
            layer_windows=layer_windows,
            hidden_act=act,
            attn_scale=attn_scale,
            attn_softcap=softcap("attn_logit_softcapping"),
            final_softcap=softcap("final_logit_softcapping"),
            local_rope_theta=local_theta,
            local_rope_scaling=local_scaling,
            generation_defaults=defaults,
        )


def _resolve_windows(
    raw: dict[str, Any], spec: ArchSpec, num_layers: int, source: str
) -> tuple[int | None, tuple[int | None, ...] | None]:
    """(window width or None, per-layer windows or None for "the width in every layer")."""
    if spec.sliding_window_key is None:
        return None, None
    if spec.sliding_window_enable_key is not None and not raw.get(spec.sliding_window_enable_key, False):
        return None, None
    window = raw.get(spec.sliding_window_key)
    if window is None:
        return None, None
    window = int(window)
    if window < 1:
        raise ValueError(f"{source}: '{spec.sliding_window_key}' must be >= 1, got {window}")
    if raw.get("use_bidirectional_attention"):
        raise ValueError(f"{source}: 'use_bidirectional_attention' is not supported (causal decoders only)")
    types = raw.get("layer_types")
    if types is None:
        if spec.window_layers == "all":
            return window, None
        if spec.window_layers == "from_max_window_layers":
            first = int(raw.get("max_window_layers", num_layers))
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
        elif spec.window_layers == "alternate":
            types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]
        else:
            pattern = int(raw.get("sliding_window_pattern", 6))
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    if len(types) != num_layers or any(t not in _LAYER_TYPES for t in types):
        raise ValueError(
            f"{source}: field 'layer_types' must list {num_layers} entries of {list(_LAYER_TYPES)}, got {types!r}"
        )
    windows = tuple(window if t == "sliding_attention" else None for t in types)
    if all(w is None for w in windows):
        return None, None
    return window, windows


def _resolve_rope(
    raw: dict[str, Any], params: dict[str, Any] | None, head_dim: int, source: str
) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from ``params`` (transformers 5's ``rope_parameters``, or one layer
    type's entry of it) or, when None, from the classic ``rope_theta`` + ``rope_scaling`` keys."""
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
    if rope_type == "su":
        rope_type = "longrope"
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
    if rope_type == "longrope":
        return float(theta), _resolve_longrope(raw, scaling, head_dim, field_name, source)
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


def _resolve_longrope(
    raw: dict[str, Any], scaling: dict[str, Any], head_dim: int, field_name: str, source: str
) -> dict[str, Any]:
    """LongRoPE (Phi-3 / 3.5): per-frequency short and long factors and the cos/sin scale, as
    transformers' ``_compute_longrope_parameters`` derives them."""
    for key in ("short_factor", "long_factor"):
        factors = scaling.get(key)
        if not isinstance(factors, list) or len(factors) != head_dim // 2:
            raise ValueError(
                f"{source}: '{field_name}' of type 'longrope' needs '{key}' as a list of {head_dim // 2} numbers"
            )
    original = scaling.get("original_max_position_embeddings") or raw.get("original_max_position_embeddings")
    if original is None:
        raise ValueError(f"{source}: '{field_name}' of type 'longrope' lacks 'original_max_position_embeddings'")
    original = int(original)
    factor = scaling.get("factor")
    if factor is None:
        factor = int(raw.get("max_position_embeddings") or original) / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return {
        "rope_type": "longrope",
        "short_factor": [float(f) for f in scaling["short_factor"]],
        "long_factor": [float(f) for f in scaling["long_factor"]],
        "original_max_position_embeddings": original,
        "attention_factor": float(attention_factor),
    }
