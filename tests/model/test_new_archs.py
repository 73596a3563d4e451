"""Qwen3, Gemma 2, Gemma 3 and Phi-3 in the generic decoder, against transformers (CPU, float32).

Tiny random checkpoints (helpers/tiny_models.py ``NEW_ARCHS``) exercise each family's features:
Qwen3's q/k norms and a sliding-window layer; Gemma 2's GeGLU, ``1 + weight`` norms, sandwich
norms, scaled embeddings, attention and final soft-capping, ``query_pre_attn_scalar`` and
alternating window / global layers; Gemma 3's q/k norms, local RoPE base, linear-scaled global
RoPE and final soft-cap; Phi-3's fused ``qkv_proj`` / ``gate_up_proj`` checkpoint and LongRoPE
(short factors up to 24 tokens, long ones beyond). Windows are 8 tokens: every prompt crosses them.

Checked, per architecture: logits of a ragged step mixing prefill, a prefill chunk and decode over
shuffled pages equal transformers' (the torch reference; the Triton kernels under the interpreter
for Gemma 2's soft-cap and windows); greedy generation equals ``generate`` (for Phi-3 it crosses
LongRoPE's switch mid-generation, as ``generate`` does); and at the executor level a PEFT-made
LoRA (Phi-3's on the fused modules) and a compressed delta give transformers' tokens for the PEFT
model and the dense reference, in one batch with the base.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
import torch

from deltaserve.kernels import common as kernel_common
from deltaserve.model import DecoderLM, ForwardBatch, PagedKVCache, load_model
from deltaserve.model.arch import PHI3_LINEARS

pytest.importorskip("peft")
from helpers.deltas import make_delta  # noqa: E402
from helpers.executors import make_executor  # noqa: E402
from helpers.peft_adapters import SEVEN, hf_model, make_peft_adapter  # noqa: E402
from helpers.sched_driver import SchedDriver  # noqa: E402
from helpers.tiny_models import LONGROPE_ORIGINAL, NEW_ARCHS, WINDOW, make_tiny_model  # noqa: E402

ATOL = 1e-4
BLOCK = 4


@dataclasses.dataclass
class Pair:
    arch: str
    path: Path
    ours: DecoderLM
    hf: torch.nn.Module


@pytest.fixture(scope="module", params=NEW_ARCHS)
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Pair:
    path = make_tiny_model(tmp_path_factory.mktemp("new_archs"), request.param)
    hf = hf_model(path)
    hf.generation_config.eos_token_id = None  # references generate past EOS, as the tests do
    return Pair(request.param, path, load_model(path), hf)


def tokens(seed: int, n: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def test_config_has_the_family_features(pair: Pair) -> None:
    cfg = pair.ours.config
    if pair.arch == "qwen3":
        assert cfg.arch.qk_norm and cfg.layer_windows == (None, WINDOW)
    elif pair.arch == "gemma2":
        assert cfg.layer_windows == (WINDOW, None) and cfg.hidden_act == "gelu_pytorch_tanh"
        assert (cfg.attn_softcap, cfg.final_softcap, cfg.scale) == (4.0, 12.0, 24**-0.5)
    elif pair.arch == "gemma3":
        assert cfg.layer_windows == (WINDOW, None, WINDOW) and cfg.local_rope_theta == 10000.0
        assert cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0} and cfg.final_softcap == 12.0
    else:
        assert cfg.arch.linear_names == PHI3_LINEARS and cfg.sliding_window is None
        assert cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "longrope"
        assert cfg.rope_scaling["original_max_position_embeddings"] == LONGROPE_ORIGINAL
    assert len(cfg.eos_token_ids) == 2  # both ids of generation_config.json


def ragged_steps(pair: Pair, plans: list[list[tuple[int, int, int]]], lengths: list[int]) -> None:
    """Runs ``plans`` (per step: (sequence, first position, end position)) over shuffled pages and
    checks every row's logits against transformers' full forward of each sequence."""
    cfg = pair.ours.config
    full = [tokens(10 + i, n, cfg.vocab_size) for i, n in enumerate(lengths)]
    with torch.no_grad():
        refs = [pair.hf(torch.tensor([ids])).logits[0] for ids in full]
    pages = list(range(1, 40))
    random.Random(3).shuffle(pages)
    tables = [pages[10 * i : 10 * i + 10] for i in range(len(full))]
    kv = PagedKVCache(cfg.num_layers, 40, BLOCK, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    for plan in plans:
        batch = ForwardBatch.build([(full[s][lo:hi], lo, tables[s], True) for s, lo, hi in plan], BLOCK)
        batch = dataclasses.replace(batch, logits_indices=torch.arange(batch.num_tokens))
        with torch.no_grad():
            out = pair.ours(batch, kv)
        want = torch.cat([refs[s][lo:hi] for s, lo, hi in plan])
        torch.testing.assert_close(out, want, atol=ATOL, rtol=0)


def test_ragged_step_logits_match_hf(pair: Pair) -> None:
    """Step 1 prefills three sequences (one only partly); step 2 decodes one, continues the chunk of
    another and decodes the third. Lengths stay on one side of LongRoPE's 24 throughout (a chunk's
    rows use the long factors when its sequence is longer than 24 by then)."""
    ragged_steps(pair, [[(0, 0, 12), (1, 0, 12), (2, 0, 29)], [(0, 12, 13), (1, 12, 18), (2, 29, 30)]], [13, 18, 30])


def test_triton_kernels_match_hf(pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Triton kernels (interpreted on CPU) on Gemma 2's soft-cap with its window and global
    layers: one prefill step past the window, then a step mixing a decode row with a prefill
    (the other families' features are outside attention; the soft-cap kernels' own tests are in
    tests/kernels/test_paged_attention_softcap.py)."""
    if pair.arch != "gemma2":
        pytest.skip("the attention-kernel features (soft-cap, per-layer windows) are Gemma 2's")
    monkeypatch.setattr(kernel_common, "_backend", "triton")
    ragged_steps(pair, [[(0, 0, 12)], [(0, 12, 13), (1, 0, 10)]], [13, 10])


def decode(model: DecoderLM, prompt: list[int], steps: int, feed: list[int] | None = None) -> torch.Tensor:
    """Prefill ``prompt``, then ``steps`` decode steps (each feeding ``feed``'s next token, or the
    argmax); returns the logits of every step [steps + 1, vocab]."""
    cfg = model.config
    kv = PagedKVCache(cfg.num_layers, 16, BLOCK, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    table, rows, seq = list(range(1, 16)), [], (prompt, 0)
    with torch.no_grad():
        for i in range(steps + 1):
            rows.append(model(ForwardBatch.build([(*seq, table, True)], BLOCK), kv)[0])
            nxt = int(rows[-1].argmax()) if feed is None else feed[i]
            seq = ([nxt], len(prompt) + i)
    return torch.stack(rows)


def test_greedy_generation_matches_hf_generate(pair: Pair) -> None:
    """14 + 16 tokens: past the window. Phi-3 stops at 24: ``generate`` recomputes the whole cache
    with the long factors once a sequence passes LongRoPE's 24 (next test)."""
    from helpers.executors import hf_greedy

    prompt = tokens(7, 14, pair.ours.config.vocab_size)
    n = LONGROPE_ORIGINAL - len(prompt) if pair.arch == "phi3" else 16
    ours = decode(pair.ours, prompt, n - 1).argmax(-1).tolist()
    assert ours == hf_greedy(pair.hf, prompt, n)


def test_longrope_crossing_equals_transformers_forward_with_its_cache(pair: Pair) -> None:
    """A Phi-3 sequence growing past 24 tokens: each step's logits equal transformers' forward over
    its cache, which rotates the tokens of a sequence longer than 24 with the long factors and keeps
    the keys cached before (``generate`` instead recomputes them once: a known difference)."""
    if pair.arch != "phi3":
        pytest.skip("LongRoPE is Phi-3's")
    from transformers import DynamicCache

    ids = tokens(8, 30, pair.ours.config.vocab_size)
    ours = decode(pair.ours, ids[:14], 15, feed=ids[14:])
    cache, want = DynamicCache(), []
    with torch.no_grad():
        want.append(pair.hf(torch.tensor([ids[:14]]), cache=cache, use_cache=True).logits[0, -1])
        for p in range(14, 29):
            out = pair.hf(torch.tensor([[ids[p]]]), cache=cache, use_cache=True, position_ids=torch.tensor([[p]]))
            want.append(out.logits[0, -1])
    torch.testing.assert_close(ours, torch.stack(want), atol=ATOL, rtol=0)


# ----------------------------------------------------------------------------- LoRA and deltas

BASE, LORA, DELTA = 0, 1, 2


@pytest.fixture(scope="module")
def variants(pair: Pair, tmp_path_factory: pytest.TempPathFactory):
    """(LoRA dir, PEFT model, delta dir, the delta's dense reference in transformers)."""
    root = tmp_path_factory.mktemp(f"variants-{pair.arch}")
    targets = list(PHI3_LINEARS) if pair.arch == "phi3" else SEVEN
    peft_model, lora_dir = make_peft_adapter(
        pair.path, root / "lora", seed=5, target_modules=targets, r=4, lora_alpha=8
    )
    delta_dir, ref_dir = make_delta(pair.path, root / "delta", seed=9, bits=4)
    delta_ref = hf_model(ref_dir)
    for ref in (peft_model, delta_ref):
        ref.generation_config.eos_token_id = None
    return lora_dir, peft_model, delta_dir, delta_ref


def test_lora_and_delta_in_one_batch_match_transformers(pair: Pair, variants) -> None:
    from helpers.executors import hf_greedy

    lora_dir, peft_model, delta_dir, delta_ref = variants
    ex = make_executor(pair.path)
    refs = {BASE: pair.hf, LORA: peft_model, DELTA: delta_ref}
    prompt = tokens(20, 11, pair.ours.config.vocab_size)
    with torch.no_grad():
        want = {aid: hf_greedy(ref, prompt, 4) for aid, ref in refs.items()}
    assert want[LORA] != want[BASE] != want[DELTA]  # the variants change the output
    router = SchedDriver(ex, {LORA: lora_dir, DELTA: delta_dir}, {LORA: LORA, DELTA: DELTA})
    got = router.run({aid: (prompt, 4) for aid in want})  # one batch: base, LoRA, delta
    assert got == want
