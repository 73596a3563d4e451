"""Tiny random HF checkpoints with a real tokenizer, for tests (no model hub, a second each).

``make_tiny_model(tmp_path, arch)`` writes a complete HF directory:

- ``config.json`` + ``model.safetensors`` from ``transformers`` (Llama / Llama-3 rope scaling /
  Mistral with a small sliding window / Qwen2 with q/k/v bias / Qwen3 with q/k norms and a
  sliding-window layer / Gemma 2 with soft-capping and alternating window layers / Gemma 3 with
  q/k norms, local RoPE and a final soft-cap / Phi-3 with fused checkpoint projections and
  LongRoPE): hidden 64, 2-3 layers, 4 heads, 2 kv heads (GQA), intermediate 128,
  max_position_embeddings 512. Windows are 8 tokens, LongRoPE's original length 24: tests'
  prompts cross both. Weights are drawn with a large
  ``initializer_range`` so greedy argmax is far from ties.
- ``tokenizer.json``: a byte-level BPE trained here on ``CORPUS`` with the ``tokenizers`` package;
  special tokens ``<|endoftext|>`` (bos), ``<|im_start|>``, ``<|im_end|>`` (eos).
- ``tokenizer_config.json`` with ``bos_token``, ``eos_token`` and a ChatML ``chat_template``.
- ``generation_config.json`` with the eos ids.

The model's ``vocab_size`` equals the tokenizer's vocabulary size.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BOS_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

CORPUS = """\
The quick brown fox jumps over the lazy dog. A language model reads a sequence of tokens and
predicts the next one. Serving many fine-tuned variants of one base model means the base weights
are shared, while each variant adds a small delta: a low-rank adapter, a compressed difference, or
a few replaced blocks. Requests arrive at random times, with prompts of different lengths, and the
server must batch them together so that the expensive matrix multiplications run once for all of
them. The key and value cache grows with every generated token; it is stored in pages of a fixed
size, and a table maps each sequence to its pages, so memory is never wasted on padding. When the
cache is full, the scheduler pauses a request, frees its pages, and resumes it later. Once upon a
time there was a little robot who lived in a quiet town by the sea. Every morning it walked to the
harbour, counted the boats, and wrote the numbers in a small blue book. The fishermen laughed at
first, but soon they asked the robot how many boats had gone out and how many had come back. One
stormy night a boat did not return, and the robot read its book again and again. It noticed that
the missing boat always sailed north when the wind came from the west. So the people took lanterns
and rowed north, and before dawn they found the boat near the rocks, its crew cold but safe. From
that day the town kept the blue book in the library, and children learned to count by reading it.
Hello world! How are you today? I am fine, thank you. What is the capital of France? Paris is the
capital of France. Two plus two equals four. Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 100 1000.
def add(a, b): return a + b  # a tiny function, written in Python, with a comment.
The system prompt says: you are a helpful assistant. The user asks a question, and the assistant
answers briefly and politely, then stops. Reverse the word apple: elppa. Uppercase the word cat: CAT.
"""

# Shared shape of every tiny model; per-architecture extras below.
_BASE: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    initializer_range=0.15,
    tie_word_embeddings=False,
)


def train_tokenizer(out_dir: Path, vocab_size: int = 512):  # noqa: ANN201 (tokenizers.Tokenizer)
    """Train the byte-level BPE on ``CORPUS`` and write ``tokenizer.json`` into ``out_dir``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS], trainer)
    tok.save(str(out_dir / "tokenizer.json"))
    return tok


def make_tiny_model(tmp_path: Path | str, arch: str = "llama", seed: int = 0, **overrides: Any) -> Path:
    """Write a tiny random HF checkpoint + tokenizer under ``tmp_path/<arch>-<seed>``; return the dir.

    ``arch``: "llama", "llama3" (llama3 rope scaling, 3 layers), "mistral" (sliding window 16),
    "qwen2" (q/k/v bias), "qwen3", "gemma2", "gemma3", "phi3" (``NEW_ARCHS``). ``overrides`` go into the transformers config
    (e.g. ``tie_word_embeddings=True``).
    """
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    suffix = "-".join(f"{k}={v}" for k, v in sorted(overrides.items()))
    out = Path(tmp_path) / (f"{arch}-{seed}" + (f"-{suffix}" if suffix else ""))
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(out)
    vocab = tok.get_vocab_size()
    bos_id, eos_id = tok.token_to_id(BOS_TOKEN), tok.token_to_id(EOS_TOKEN)
    endoftext_id = tok.token_to_id("<|endoftext|>")

    kwargs: dict[str, Any] = dict(_BASE, vocab_size=vocab, bos_token_id=bos_id, eos_token_id=eos_id)
    if arch == "llama":
        config_cls, model_cls = LlamaConfig, LlamaForCausalLM
    elif arch == "llama3":
        config_cls, model_cls = LlamaConfig, LlamaForCausalLM
        kwargs.update(
            num_hidden_layers=3,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    elif arch == "mistral":
        config_cls, model_cls = MistralConfig, MistralForCausalLM
        kwargs.update(sliding_window=16, head_dim=16)
    elif arch == "qwen2":
        config_cls, model_cls = Qwen2Config, Qwen2ForCausalLM
        kwargs.update(use_sliding_window=False, rope_theta=1000000.0)
    elif arch in NEW_ARCHS:
        config_cls, model_cls = _new_arch(arch, kwargs)
    else:
        raise ValueError(
            f"make_tiny_model: unknown arch {arch!r} (llama, llama3, mistral, qwen2, {', '.join(NEW_ARCHS)})"
        )
    kwargs.update(overrides)
    config = config_cls(**kwargs)

    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    with torch.no_grad():
        # Non-trivial norm weights and biases so the tests see them (HF initialises 1 / 0).
        gen = torch.Generator().manual_seed(seed + 1)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                centre = 0.0 if arch.startswith("gemma") else 1.0  # Gemma scales by 1 + weight
                p.copy_(centre + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        # Peaked logits (std ~3.5): greedy choices are not decided by fp noise.
        if arch.startswith("gemma"):  # tied head over embeddings scaled by sqrt(hidden) = 8
            model.lm_head.weight.mul_(3.0 / 8.0 if config.tie_word_embeddings else 3.0)
        else:
            model.lm_head.weight.mul_(3.0)
    model.generation_config.eos_token_id = [eos_id, endoftext_id]
    model.generation_config.bos_token_id = bos_id
    model.generation_config.pad_token_id = endoftext_id
    model.save_pretrained(out, safe_serialization=True)

    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": BOS_TOKEN,
                "eos_token": EOS_TOKEN,
                "pad_token": "<|endoftext|>",
                "add_bos_token": False,
                "model_max_length": 512,
                "chat_template": CHATML_TEMPLATE,
            },
            indent=2,
        )
    )
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": "<|endoftext|>"}, indent=2)
    )
    return out


NEW_ARCHS = ("qwen3", "gemma2", "gemma3", "phi3")
"""The architectures added with issue 25 (``_new_arch``)."""
WINDOW = 8
"""Sliding window of the tiny Qwen3 / Gemma models: smaller than the tests' prompts."""
LONGROPE_ORIGINAL = 24
"""The tiny Phi-3's ``original_max_position_embeddings``: longer sequences use LongRoPE's long factors."""


def _new_arch(arch: str, kwargs: dict[str, Any]):  # noqa: ANN202 (config class, model class)
    """Config and model classes of a ``NEW_ARCHS`` tiny model; its extra fields go into ``kwargs``."""
    import transformers

    kwargs["head_dim"] = 16
    if arch == "qwen3":
        # Layer 1 slides (layers >= max_window_layers), layer 0 is global.
        kwargs.update(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1, rope_theta=1000000.0)
        return transformers.Qwen3Config, transformers.Qwen3ForCausalLM
    if arch == "gemma2":
        # Layer 0 slides, layer 1 is global; caps small enough to bite at initializer_range 0.15.
        kwargs.update(
            sliding_window=WINDOW,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=4.0,
            final_logit_softcapping=12.0,
            hidden_activation="gelu_pytorch_tanh",
            pad_token_id=0,
        )
        return transformers.Gemma2Config, transformers.Gemma2ForCausalLM
    if arch == "gemma3":
        kwargs.update(
            num_hidden_layers=3,
            sliding_window=WINDOW,
            sliding_window_pattern=2,  # layers 0 and 2 slide with the local RoPE, layer 1 is global
            query_pre_attn_scalar=16,
            final_logit_softcapping=12.0,
            rope_theta=1000000.0,
            rope_local_base_freq=10000.0,
            rope_scaling={"rope_type": "linear", "factor": 2.0},
            hidden_activation="gelu_pytorch_tanh",
            pad_token_id=0,
        )
        return transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM
    half = kwargs["head_dim"] // 2
    kwargs.update(
        intermediate_size=64,  # a LoRA B column of the fused gate_up_proj (128) fits a page half at block size 4
        original_max_position_embeddings=LONGROPE_ORIGINAL,
        rope_scaling={
            "type": "longrope",
            "short_factor": [1.0 + 0.05 * i for i in range(half)],
            "long_factor": [1.5 + 0.5 * i for i in range(half)],
            "original_max_position_embeddings": LONGROPE_ORIGINAL,
        },
        pad_token_id=0,
    )
    return transformers.Phi3Config, transformers.Phi3ForCausalLM
