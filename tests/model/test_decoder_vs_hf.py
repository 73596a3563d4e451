"""DecoderLM + paged KV cache against HF transformers, on tiny random checkpoints (CPU, fp32).

Covers every row of ARCH_TABLE (Llama, Llama-3 rope scaling, Mistral sliding window, Qwen2 q/k/v
bias) and tied embeddings, for: one prefill; chunked prefill then decode; a ragged batch mixing
prefill, chunk and decode over shuffled pages; greedy generation vs ``generate``; batch
invariance; and the loader's refusals.
"""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from deltaserve.model import (
    ARCH_TABLE,
    DecoderLM,
    ForwardBatch,
    ModelConfig,
    PagedKVCache,
    load_model,
    random_model,
)

ATOL = 1e-4
ARCH_FIXTURES = {
    "llama": "tiny_llama",
    "llama3": "tiny_llama3",
    "mistral": "tiny_mistral",
    "qwen2": "tiny_qwen2",
    "tied": "tiny_llama_tied",
}


@dataclasses.dataclass
class Pair:
    ours: DecoderLM
    hf: torch.nn.Module
    path: Path


@pytest.fixture(scope="module", params=list(ARCH_FIXTURES))
def pair(request: pytest.FixtureRequest) -> Pair:
    path = request.getfixturevalue(ARCH_FIXTURES[request.param])
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return Pair(load_model(path), hf, path)


class Pages:
    """Hands out page ids from a shuffled pool, so no sequence gets contiguous pages."""

    def __init__(self, num_blocks: int, seed: int) -> None:
        self.free = list(range(1, num_blocks))  # page 0 stays unused: padding points there
        random.Random(seed).shuffle(self.free)

    def table(self, num_tokens: int, block_size: int) -> list[int]:
        n = -(-num_tokens // block_size)
        out, self.free = self.free[:n], self.free[n:]
        assert len(out) == n, "test pool too small"
        return out


def new_cache(model: DecoderLM, num_blocks: int, block_size: int) -> PagedKVCache:
    cfg = model.config
    return PagedKVCache(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")


def tokens(seed: int, n: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()  # skip the special tokens


@torch.no_grad()
def hf_logits(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([ids])).logits[0].float()


@torch.no_grad()
def step(model: DecoderLM, kv: PagedKVCache, seqs, all_rows: bool = True) -> torch.Tensor:  # noqa: ANN001
    """One forward; with all_rows, logits for every scheduled token (not only the last)."""
    batch = ForwardBatch.build(seqs, kv.block_size)
    if all_rows:
        batch = dataclasses.replace(batch, logits_indices=torch.arange(batch.num_tokens))
    return model(batch, kv)


@pytest.mark.parametrize("block_size", [4, 16])
def test_single_prefill_matches_hf(pair: Pair, block_size: int) -> None:
    ids = tokens(1, 37, pair.ours.config.vocab_size)
    kv = new_cache(pair.ours, 32, block_size)
    table = Pages(32, seed=block_size).table(len(ids), block_size)
    ours = step(pair.ours, kv, [(ids, 0, table, True)])
    torch.testing.assert_close(ours, hf_logits(pair.hf, ids), atol=ATOL, rtol=0)
    # Only the last row when logits_indices is the default.
    last = step(pair.ours, new_cache(pair.ours, 32, block_size), [(ids, 0, table, True)], all_rows=False)
    assert last.shape == (1, pair.ours.config.vocab_size) and last.dtype == torch.float32
    torch.testing.assert_close(last[0], ours[-1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("block_size", [4, 16])
def test_chunked_prefill_then_decode_matches_hf(pair: Pair, block_size: int) -> None:
    ids = tokens(2, 31, pair.ours.config.vocab_size)
    ref = hf_logits(pair.hf, ids)
    kv = new_cache(pair.ours, 24, block_size)
    table = Pages(24, seed=7).table(len(ids), block_size)
    # Chunks [0, 9), [9, 20), then one token at a time up to 31.
    bounds = [(0, 9), (9, 20)] + [(p, p + 1) for p in range(20, 31)]
    for lo, hi in bounds:
        out = step(pair.ours, kv, [(ids[lo:hi], lo, table, True)])
        torch.testing.assert_close(out, ref[lo:hi], atol=ATOL, rtol=0, msg=lambda m: f"rows {lo}:{hi}: {m}")


@pytest.mark.parametrize("block_size", [4, 16])
def test_ragged_mixed_batch_matches_hf(pair: Pair, block_size: int) -> None:
    vocab = pair.ours.config.vocab_size
    full = [tokens(10 + i, n, vocab) for i, n in enumerate([14, 13, 12, 24])]
    refs = [hf_logits(pair.hf, ids) for ids in full]
    pages = Pages(40, seed=block_size + 1)
    tables = [pages.table(len(ids), block_size) for ids in full]
    kv = new_cache(pair.ours, 40, block_size)

    def check(plan: list[tuple[int, int, int]]) -> None:
        """plan: (sequence, first position, end position) per scheduled sequence."""
        seqs = [(full[s][lo:hi], lo, tables[s], True) for s, lo, hi in plan]
        out = step(pair.ours, kv, seqs)
        want = torch.cat([refs[s][lo:hi] for s, lo, hi in plan])
        torch.testing.assert_close(out, want, atol=ATOL, rtol=0)

    # Step 1: three sequences prefill different amounts; sequence 2 waits.
    check([(0, 0, 12), (1, 0, 6), (3, 0, 22)])
    # Step 2: decode, chunk continuation, fresh prefill, decode; in a scrambled order.
    check([(3, 22, 23), (2, 0, 9), (0, 12, 13), (1, 6, 11)])
    # Steps 3-4: everyone decodes (or finishes its chunk), one logit row per sequence.
    check([(0, 13, 14), (1, 11, 12), (2, 9, 10), (3, 23, 24)])
    seqs = [(full[1][12:13], 12, tables[1], True), (full[2][10:11], 10, tables[2], False)]
    out = step(pair.ours, kv, seqs, all_rows=False)
    torch.testing.assert_close(out, refs[1][12:13], atol=ATOL, rtol=0)


def greedy(model: DecoderLM, prompts: list[list[int]], max_new: int, block_size: int = 4) -> list[list[int]]:
    """Greedy decoding of all prompts together: one batched prefill, then batched decode steps."""
    eos = set(model.config.eos_token_ids)
    kv = new_cache(model, 8 + len(prompts) * (-(-(max(map(len, prompts)) + max_new) // block_size)), block_size)
    pages = Pages(kv.num_blocks, seed=3)
    tables = [pages.table(len(p) + max_new, block_size) for p in prompts]
    outs: list[list[int]] = [[] for _ in prompts]
    live = list(range(len(prompts)))
    seqs = [(p, 0, tables[i], True) for i, p in enumerate(prompts)]
    while live:
        with torch.no_grad():
            logits = model(ForwardBatch.build(seqs, block_size), kv)
        nxt = logits.argmax(-1).tolist()
        still = []
        for i, tok in zip(live, nxt):
            outs[i].append(tok)
            if tok not in eos and len(outs[i]) < max_new:
                still.append(i)
        live = still
        seqs = [([outs[i][-1]], len(prompts[i]) + len(outs[i]) - 1, tables[i], True) for i in live]
    return outs


def test_greedy_generation_matches_hf_generate(pair: Pair) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(pair.path / "tokenizer.json"))
    prompt = tok.encode("Once upon a time there was a little robot").ids
    ours = greedy(pair.ours, [prompt], max_new=20)[0]
    with torch.no_grad():
        ref = pair.hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=20)[0, len(prompt) :]
    assert ours == ref.tolist()
    assert len(ours) == 20, "a tiny model hit eos early; pick another prompt so the test covers 20 tokens"


def test_batch_invariance_greedy(tiny_llama: Path) -> None:
    model = load_model(tiny_llama)
    vocab = model.config.vocab_size
    prompts = [tokens(100 + i, 3 + (7 * i) % 29, vocab) for i in range(16)]
    together = greedy(model, prompts, max_new=12)
    alone = [greedy(model, [p], max_new=12)[0] for p in prompts]
    assert together == alone
    assert all(len(t) == 12 for t in together)


def test_mistral_sliding_window_is_applied(tiny_mistral: Path) -> None:
    model = load_model(tiny_mistral)
    window = model.config.sliding_window
    assert window == 16
    unwindowed = DecoderLM(dataclasses.replace(model.config, sliding_window=None))
    unwindowed.load_state_dict(model.state_dict())
    ids = tokens(5, 30, model.config.vocab_size)
    seqs = [(ids, 0, list(range(1, 9)), True)]
    a = step(model, new_cache(model, 9, 4), seqs)
    b = step(unwindowed, new_cache(model, 9, 4), seqs)
    torch.testing.assert_close(a[:window], b[:window], atol=ATOL, rtol=0)
    assert (a[window:] - b[window:]).abs().max() > 1e-2


# ----------------------------------------------------------------------------- config and loader


def test_config_resolution(tiny_llama3: Path, tiny_qwen2: Path, tiny_mistral: Path) -> None:
    cfg = ModelConfig.from_model_dir(tiny_llama3)
    assert cfg.architecture == "LlamaForCausalLM" and cfg.arch is ARCH_TABLE["LlamaForCausalLM"]
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers) == (4, 2, 16, 3)
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    assert cfg.eos_token_ids == [2, 0] and cfg.bos_token_id == 0  # generation_config.json wins
    # The classic spelling (rope_theta + rope_scaling with "type") resolves to the same config.
    raw = json.loads((tiny_llama3 / "config.json").read_text())
    params = raw.pop("rope_parameters")
    raw["rope_theta"] = params.pop("rope_theta")
    raw["rope_scaling"] = {"type" if k == "rope_type" else k: v for k, v in params.items()}
    assert ModelConfig.from_dict(raw, {"eos_token_id": [2, 0]}) == cfg
    q = ModelConfig.from_model_dir(tiny_qwen2)
    assert q.qkv_bias and not q.o_bias and q.sliding_window is None and q.rope_scaling is None
    assert ModelConfig.from_model_dir(tiny_mistral).sliding_window == 16


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_config(path: Path, **changes: object) -> None:
    raw = json.loads((path / "config.json").read_text())
    raw.update(changes)
    (path / "config.json").write_text(json.dumps(raw))


def test_loader_refuses_missing_tensor(tiny_llama: Path, tmp_path: Path) -> None:
    d = copy_model(tiny_llama, tmp_path / "m")
    sd = load_file(d / "model.safetensors")
    del sd["model.layers.1.mlp.up_proj.weight"]
    save_file(sd, d / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing tensor.*model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(d)


def test_loader_refuses_wrong_shape(tiny_llama: Path, tmp_path: Path) -> None:
    d = copy_model(tiny_llama, tmp_path / "m")
    sd = load_file(d / "model.safetensors")
    sd["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(64, 64)
    save_file(sd, d / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight.*\[64, 64\].*\[32, 64\]"):
        load_model(d)


def test_loader_refuses_pickle_only(tiny_llama: Path, tmp_path: Path) -> None:
    d = tmp_path / "m"
    d.mkdir()
    shutil.copy(tiny_llama / "config.json", d)
    (d / "pytorch_model.bin").write_bytes(b"not unpickled")
    with pytest.raises(ValueError, match=r"pickle.*pytorch_model\.bin"):
        load_model(d)


def test_loader_refuses_unsupported_architecture(tiny_llama: Path, tmp_path: Path) -> None:
    d = copy_model(tiny_llama, tmp_path / "m")
    edit_config(d, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match=r"unsupported architecture 'GPT2LMHeadModel'"):
        load_model(d)


@pytest.mark.parametrize("spelling", ["rope_parameters", "rope_scaling"])
def test_loader_refuses_unsupported_rope_type(tiny_llama: Path, tmp_path: Path, spelling: str) -> None:
    d = copy_model(tiny_llama, tmp_path / "m")
    if spelling == "rope_parameters":
        edit_config(d, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0})
    else:
        edit_config(d, rope_parameters=None, rope_theta=10000.0, rope_scaling={"type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match=rf"unsupported rope type '(yarn|dynamic)' in field '{spelling}'"):
        load_model(d)


def test_loader_sharded_extras_and_missing_lm_head(tiny_llama: Path, tmp_path: Path) -> None:
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, safe_serialization=True, max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    base = load_model(tiny_llama)
    for name, p in load_model(sharded).state_dict().items():
        torch.testing.assert_close(p, base.state_dict()[name], atol=0, rtol=0)

    # Extra tensors (e.g. rotary inv_freq) are ignored; a missing lm_head means tied embeddings.
    d = copy_model(tiny_llama, tmp_path / "m")
    sd = load_file(d / "model.safetensors")
    del sd["lm_head.weight"]
    sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(sd, d / "model.safetensors")
    model = load_model(d)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_tied_embeddings_share_storage(tiny_llama_tied: Path) -> None:
    model = load_model(tiny_llama_tied)
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_random_model_shapes_and_determinism(tiny_qwen2: Path) -> None:
    cfg = ModelConfig.from_model_dir(tiny_qwen2)
    a = random_model(cfg, "cpu", torch.bfloat16, seed=5)
    b = random_model(cfg, "cpu", torch.bfloat16, seed=5)
    ref = load_model(tiny_qwen2).state_dict()
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == ref.keys()
    for name, t in sa.items():
        assert t.shape == ref[name].shape and t.dtype == torch.bfloat16, name
        assert torch.equal(t, sb[name]), name
    assert (sa["model.norm.weight"] == 1).all() and (sa["model.layers.0.self_attn.q_proj.bias"] == 0).all()
    c = random_model(cfg, "cpu", torch.bfloat16, seed=6).state_dict()
    assert not torch.equal(c["lm_head.weight"], sa["lm_head.weight"])
    # And it runs: bf16 forward on a fresh cache gives finite float32 logits.
    kv = PagedKVCache(cfg.num_layers, 4, 4, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, "cpu")
    with torch.no_grad():
        out = a(ForwardBatch.build([([5, 6, 7], 0, [1], True)], 4), kv)
    assert out.shape == (1, cfg.vocab_size) and out.dtype == torch.float32 and torch.isfinite(out).all()


def test_random_weights_marker_loads_real_shapes(tmp_path):
    """A config.json + random-weights.json directory loads with random weights of the config's shapes."""
    import json

    from deltaserve.model.loader import load_model

    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 100,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 64,
        "tie_word_embeddings": False,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "random-weights.json").write_text(json.dumps({"seed": 3, "std": 0.5}))
    a = load_model(tmp_path)
    b = load_model(tmp_path)
    assert a.model.layers[1].mlp.down_proj.weight.shape == (32, 64)
    assert torch.equal(a.lm_head.weight, b.lm_head.weight), "same seed, same weights"
    assert 0.3 < a.lm_head.weight.std().item() < 0.7
    (tmp_path / "random-weights.json").unlink()
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        load_model(tmp_path)
