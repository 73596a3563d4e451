"""``deltaserve.adapters.lora`` against PEFT itself: adapters made by ``peft`` on the tiny Llama.

Agreement (one PEFT adapter per case: target subsets, ranks 1/8/64, rsLoRA, alpha != r,
rank_pattern/alpha_pattern, regex targets, layers_to_transform):

- loaded A/B/rank/alpha/scaling and the set of adapted modules equal PEFT's live LoRA layers;
- ``lora_delta_ref`` equals what PEFT's LoRA layer adds to its base layer for a random x;
- ``merged_weight`` equals PEFT's ``merge_and_unload()`` weights;
- HF transformers on our merged weights gives PEFT's logits (our scaling semantics are PEFT's).

Refusals: every bad case is made by editing a saved PEFT adapter (adapter_config.json or the
safetensors file) and must raise ``LoraAdapterError`` naming the adapter dir and the field/tensor.
"""

from __future__ import annotations

import json
import pathlib
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from deltaserve.adapters.lora import (
    LoraAdapter,
    LoraAdapterError,
    load_lora_adapter,
    lora_delta_ref,
    merged_weight,
)
from deltaserve.model.arch import ModelConfig

peft = pytest.importorskip("peft")
from peft.tuners.lora import LoraLayer  # noqa: E402

from helpers.peft_adapters import SEVEN, make_peft_adapter  # noqa: E402
from helpers.peft_adapters import hf_model as _hf_model  # noqa: E402

PREFIX = "base_model.model.model.layers"


def _peft_lora_layers(pm: torch.nn.Module) -> dict[tuple[int, str], LoraLayer]:
    out = {}
    for name, mod in pm.named_modules():
        if isinstance(mod, LoraLayer) and "default" in mod.lora_A:
            parts = name.split(".")
            out[(int(parts[parts.index("layers") + 1]), parts[-1])] = mod
    return out


CASES: dict[str, dict[str, Any]] = {
    "qv_r8_alpha16": dict(target_modules=["q_proj", "v_proj"], r=8, lora_alpha=16),
    "all7_r1_alpha3": dict(target_modules=SEVEN, r=1, lora_alpha=3),
    "attention_r64_rslora": dict(
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], r=64, lora_alpha=24, use_rslora=True
    ),
    "all_linear_rank_alpha_pattern_rslora": dict(
        target_modules="all-linear",
        r=8,
        lora_alpha=5,
        use_rslora=True,
        rank_pattern={"down_proj": 4, r"layers\.1\.self_attn\.q_proj": 64},
        alpha_pattern={"o_proj": 7},
    ),
    "regex_mlp_layer1": dict(target_modules=r".*\.layers\.1\.mlp\.(gate|up)_proj", r=8, lora_alpha=12),
    "exclude_layer0_down": dict(
        target_modules=SEVEN, exclude_modules=["model.layers.0.mlp.down_proj"], r=8, lora_alpha=4
    ),
    "layers_to_transform": dict(target_modules=["q_proj", "down_proj"], layers_to_transform=[1], r=2, lora_alpha=1),
}


@pytest.fixture(scope="module")
def base_cfg(tiny_llama: Path) -> ModelConfig:
    return ModelConfig.from_model_dir(tiny_llama)


@pytest.mark.parametrize("case", list(CASES))
def test_matches_peft(case: str, tiny_llama: Path, base_cfg: ModelConfig, tmp_path: Path) -> None:
    torch.manual_seed(0)
    pm, adir = make_peft_adapter(tiny_llama, tmp_path / case, seed=list(CASES).index(case), **CASES[case])
    ad = load_lora_adapter(adir, base_cfg)
    assert ad.dtype == torch.float32

    # A, B, rank, alpha, scaling and the adapted set equal PEFT's live layers.
    peft_layers = _peft_lora_layers(pm)
    assert set(ad.modules) == set(peft_layers)
    assert ad.target_modules == {p for _, p in peft_layers}
    for (layer, proj), pl in peft_layers.items():
        w = ad.get(layer, proj)
        assert w is not None
        assert torch.equal(w.a, pl.lora_A["default"].weight), (layer, proj)
        assert torch.equal(w.b, pl.lora_B["default"].weight), (layer, proj)
        assert w.rank == pl.r["default"]
        assert w.alpha == pl.lora_alpha["default"]
        assert w.scaling == pytest.approx(pl.scaling["default"], rel=1e-12), (layer, proj)

    # lora_delta_ref equals what PEFT's layer adds to its base layer.
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for (layer, proj), pl in peft_layers.items():
            x = torch.randn(3, 5, ad.features[proj][0], generator=gen)
            want = pl(x) - pl.get_base_layer()(x)
            torch.testing.assert_close(lora_delta_ref(ad, layer, proj, x), want, rtol=1e-5, atol=1e-5)
        # Projections PEFT left alone add nothing.
        for layer in range(base_cfg.num_layers):
            for proj in SEVEN:
                if (layer, proj) not in peft_layers:
                    x = torch.randn(2, ad.features[proj][0], generator=gen)
                    assert not lora_delta_ref(ad, layer, proj, x).any()

    ids = torch.randint(0, base_cfg.vocab_size, (2, 11), generator=gen)
    with torch.no_grad():
        peft_logits = pm(input_ids=ids).logits
        merged = pm.merge_and_unload()  # mutates pm: after this it is the merged HF model
        peft_merged_logits = merged(input_ids=ids).logits
    merged_sd = merged.state_dict()

    # Our merge of the pristine base weights equals PEFT's merge, module by module.
    base_sd = _hf_model(tiny_llama).state_dict()
    ours_sd = dict(base_sd)
    for layer in range(base_cfg.num_layers):
        for proj in SEVEN:
            key = f"model.layers.{layer}.{'self_attn' if proj in SEVEN[:4] else 'mlp'}.{proj}.weight"
            ours_sd[key] = merged_weight(ad, base_sd[key], layer, proj)
            torch.testing.assert_close(ours_sd[key], merged_sd[key], rtol=1e-5, atol=1e-5)
            if (layer, proj) in peft_layers:
                assert not torch.equal(ours_sd[key], base_sd[key]), key

    # HF transformers on our merged weights reproduces PEFT's unmerged logits.
    ref = _hf_model(tiny_llama)
    ref.load_state_dict(ours_sd)
    with torch.no_grad():
        ours_logits = ref(input_ids=ids).logits
        base_logits = _hf_model(tiny_llama)(input_ids=ids).logits
    # Same weights as PEFT's merge -> the same logits; against PEFT's unmerged forward the gap is
    # fp32 reassociation (PEFT's own merged-vs-unmerged gap), far below the adapter's effect.
    torch.testing.assert_close(ours_logits, peft_merged_logits, rtol=0, atol=1e-5)
    scale = peft_logits.abs().max().item()
    torch.testing.assert_close(ours_logits, peft_logits, rtol=0, atol=1e-4 * scale)
    assert (ours_logits - base_logits).abs().max() > 0.1 * scale  # the adapter visibly changes the model


def test_all_linear_string(tiny_llama: Path, base_cfg: ModelConfig, tmp_path: Path) -> None:
    """PEFT saves "all-linear" expanded to module names; the literal string is accepted too."""
    _, adir = make_peft_adapter(tiny_llama, tmp_path / "al", target_modules="all-linear", r=4, lora_alpha=8)
    expanded = load_lora_adapter(adir, base_cfg)
    _edit_config(adir, target_modules="all-linear")
    literal = load_lora_adapter(adir, base_cfg)
    assert set(literal.modules) == set(expanded.modules) == {(i, p) for i in range(2) for p in SEVEN}


def test_dtypes(tiny_llama: Path, base_cfg: ModelConfig, tmp_path: Path) -> None:
    _, adir = make_peft_adapter(tiny_llama, tmp_path / "bf16", dtype=torch.bfloat16, target_modules=["v_proj"], r=4)
    stored = load_lora_adapter(adir, base_cfg)
    assert stored.dtype == torch.bfloat16 and stored.get(0, "v_proj").a.dtype == torch.bfloat16
    as_f16 = load_lora_adapter(adir, base_cfg, dtype=torch.float16)
    w = as_f16.get(1, "v_proj")
    assert w.a.dtype == w.b.dtype == torch.float16 and as_f16.dtype == torch.float16
    torch.testing.assert_close(w.a.float(), stored.get(1, "v_proj").a.float(), rtol=1e-2, atol=1e-2)
    assert as_f16.nbytes == sum(x.a.numel() + x.b.numel() for x in as_f16.modules.values()) * 2
    with pytest.raises(LoraAdapterError, match="requested dtype"):
        load_lora_adapter(adir, base_cfg, dtype=torch.float64)


def test_reference_helpers_check_their_arguments(tiny_llama: Path, base_cfg: ModelConfig, tmp_path: Path) -> None:
    _, adir = make_peft_adapter(tiny_llama, tmp_path / "a", target_modules=["q_proj"], r=2)
    ad = load_lora_adapter(adir, base_cfg)
    with pytest.raises(ValueError, match="unknown projection 'lm_head'"):
        lora_delta_ref(ad, 0, "lm_head", torch.zeros(1, 64))
    with pytest.raises(ValueError, match="layer 2 out of range"):
        ad.get(2, "q_proj")
    with pytest.raises(ValueError, match="x has 32 features, expected 64"):
        lora_delta_ref(ad, 0, "q_proj", torch.zeros(1, 32))
    with pytest.raises(ValueError, match=r"base weight has shape \[64, 32\]"):
        merged_weight(ad, torch.zeros(64, 32), 0, "q_proj")


# ------------------------------------------------------------------------------------------ refusals


@pytest.fixture(scope="module")
def good_adapter(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("lora_good") / "adapter"
    make_peft_adapter(tiny_llama, out, target_modules=["q_proj", "v_proj", "down_proj"], r=8, lora_alpha=16)
    return out


def _edit_config(d: Path, **changes: Any) -> None:
    p = d / "adapter_config.json"
    cfg = json.loads(p.read_text())
    cfg.update(changes)
    p.write_text(json.dumps(cfg))


def _edit_tensors(d: Path, fn: Callable[[dict[str, torch.Tensor]], None]) -> None:
    p = d / "adapter_model.safetensors"
    tensors = load_file(p)
    fn(tensors)
    save_file(tensors, p)


Q_A = f"{PREFIX}.0.self_attn.q_proj.lora_A.weight"
Q_B = f"{PREFIX}.0.self_attn.q_proj.lora_B.weight"
V_B = f"{PREFIX}.1.self_attn.v_proj.lora_B.weight"
DOWN_A = f"{PREFIX}.1.mlp.down_proj.lora_A.weight"


def _set(key: str, value: torch.Tensor) -> Callable[[dict[str, torch.Tensor]], None]:
    return lambda t: t.__setitem__(key, value)


def _poke(key: str, value: float) -> Callable[[dict[str, torch.Tensor]], None]:
    def fn(t: dict[str, torch.Tensor]) -> None:
        t[key] = t[key].clone()
        t[key][0, 0] = value

    return fn


def _drop(*keys: str) -> Callable[[dict[str, torch.Tensor]], None]:
    return lambda t: [t.pop(k) for k in keys]


def _rm(name: str) -> Callable[[Path], None]:
    return lambda d: (d / name).unlink()


# (id, how to break the saved adapter, substrings the error must contain)
REFUSALS: list[tuple[str, Callable[[Path], None], list[str]]] = [
    ("missing_config", _rm("adapter_config.json"), ["missing adapter_config.json"]),
    ("missing_weights", _rm("adapter_model.safetensors"), ["missing adapter_model.safetensors"]),
    (
        "bad_json",
        lambda d: (d / "adapter_config.json").write_text("{not json"),
        ["adapter_config.json is not valid JSON"],
    ),
    (
        "corrupt_safetensors",
        lambda d: (d / "adapter_model.safetensors").write_bytes(b"\x10\x00garbage"),
        ["adapter_model.safetensors cannot be read"],
    ),  # noqa: E501
    ("peft_type", lambda d: _edit_config(d, peft_type="LOHA"), ["'peft_type'", "'LOHA'"]),
    ("dora", lambda d: _edit_config(d, use_dora=True), ["'use_dora'", "DoRA"]),
    ("lora_bias", lambda d: _edit_config(d, lora_bias=True), ["'lora_bias'"]),
    ("modules_to_save", lambda d: _edit_config(d, modules_to_save=["lm_head"]), ["'modules_to_save'", "lm_head"]),
    ("fan_in_fan_out", lambda d: _edit_config(d, fan_in_fan_out=True), ["'fan_in_fan_out'", "Conv1D"]),
    ("bias", lambda d: _edit_config(d, bias="all"), ["'bias'", "'all'"]),
    ("rank_too_big", lambda d: _edit_config(d, r=300), ["field 'r'", "300", "1..256"]),
    ("rank_zero", lambda d: _edit_config(d, r=0), ["field 'r'", "1..256"]),
    (
        "rank_pattern_too_big",
        lambda d: _edit_config(d, rank_pattern={"q_proj": 257}),
        ["'rank_pattern' entry 'q_proj'", "257"],
    ),  # noqa: E501
    ("alpha_not_number", lambda d: _edit_config(d, lora_alpha="16"), ["'lora_alpha'"]),
    (
        "target_lm_head",
        lambda d: _edit_config(d, target_modules=["q_proj", "lm_head"]),
        ["'target_modules' entry 'lm_head'"],
    ),  # noqa: E501
    (
        "target_embed",
        lambda d: _edit_config(d, target_modules=["embed_tokens", "q_proj"]),
        ["'target_modules' entry 'embed_tokens'"],
    ),  # noqa: E501
    (
        "target_regex_lm_head",
        lambda d: _edit_config(d, target_modules=r".*(q_proj|lm_head)"),
        ["'target_modules' regex", "'lm_head'"],
    ),  # noqa: E501
    (
        "target_layer_beyond",
        lambda d: _edit_config(d, target_modules=["model.layers.7.self_attn.q_proj"]),
        ["'target_modules' entry 'model.layers.7.self_attn.q_proj'", "layers 0..1"],
    ),  # noqa: E501
    (
        "layers_to_transform_beyond",
        lambda d: _edit_config(d, layers_to_transform=[0, 7]),
        ["'layers_to_transform'", "[7]", "num_layers=2"],
    ),  # noqa: E501
    ("rank_vs_config", lambda d: _edit_config(d, r=4), [Q_A, "[8, 64]", "[4, 64]"]),
    (
        "untargeted_tensor",
        lambda d: _edit_config(d, target_modules=["q_proj", "down_proj"]),
        ["v_proj.lora_A.weight", "not targeted"],
    ),  # noqa: E501
    (
        "lm_head_tensor",
        lambda d: _edit_tensors(d, _set("base_model.model.lm_head.lora_A.weight", torch.zeros(8, 64))),
        ["'base_model.model.lm_head.lora_A.weight'", "lm_head"],
    ),  # noqa: E501
    (
        "embed_tensor",
        lambda d: _edit_tensors(d, _set("base_model.model.model.embed_tokens.lora_embedding_A", torch.zeros(8, 10))),
        ["'base_model.model.model.embed_tokens.lora_embedding_A'"],
    ),  # noqa: E501
    (
        "dora_magnitude_tensor",
        lambda d: _edit_tensors(d, _set(f"{PREFIX}.0.self_attn.q_proj.lora_magnitude_vector", torch.ones(64))),
        ["lora_magnitude_vector"],
    ),  # noqa: E501
    (
        "unknown_linear_tensor",
        lambda d: _edit_tensors(d, _set(f"{PREFIX}.0.self_attn.rotary_proj.lora_A.weight", torch.zeros(8, 64))),
        ["rotary_proj.lora_A.weight", "adaptable linears"],
    ),  # noqa: E501
    (
        "layer_beyond",
        lambda d: _edit_tensors(d, _set(f"{PREFIX}.5.self_attn.q_proj.lora_A.weight", torch.zeros(8, 64))),
        [f"{PREFIX}.5.self_attn.q_proj.lora_A.weight", "num_layers=2"],
    ),  # noqa: E501
    ("shape_in", lambda d: _edit_tensors(d, _set(Q_A, torch.zeros(8, 32))), [Q_A, "[8, 32]", "[8, 64]"]),
    ("shape_out", lambda d: _edit_tensors(d, _set(V_B, torch.zeros(64, 8))), [V_B, "[64, 8]", "[32, 8]"]),
    ("dtype_f64", lambda d: _edit_tensors(d, _set(Q_B, torch.zeros(64, 8, dtype=torch.float64))), [Q_B, "float64"]),
    ("dtype_int", lambda d: _edit_tensors(d, _set(Q_B, torch.zeros(64, 8, dtype=torch.int32))), [Q_B, "int32"]),
    ("nan", lambda d: _edit_tensors(d, _poke(DOWN_A, float("nan"))), [DOWN_A, "non-finite"]),
    ("inf", lambda d: _edit_tensors(d, _poke(Q_B, float("inf"))), [Q_B, "non-finite"]),
    ("a_without_b", lambda d: _edit_tensors(d, _drop(Q_B)), [Q_A, "no matching lora_B"]),
    (
        "targeted_without_tensors",
        lambda d: _edit_tensors(d, _drop(Q_A, Q_B)),
        ["model.layers.0.self_attn.q_proj", "no lora_A/lora_B"],
    ),  # noqa: E501
    # Issue 28: configs that crashed the worker (exceptions outside LoraAdapterError) are refusals.
    ("exclude_bad_regex", lambda d: _edit_config(d, exclude_modules="("), ["'exclude_modules'", "refused"]),
    ("rank_pattern_bad_regex", lambda d: _edit_config(d, rank_pattern={"(": 4}), ["'rank_pattern' key #0"]),
    ("alpha_pattern_bad_regex", lambda d: _edit_config(d, alpha_pattern={"q[": 4}), ["'alpha_pattern' key #0"]),
    (
        "layers_pattern_not_string",
        lambda d: _edit_config(d, layers_to_transform=[0, 1], layers_pattern=5),
        ["'layers_pattern'", "string"],
    ),
    (
        "layers_pattern_bad_regex",
        lambda d: _edit_config(d, layers_to_transform=[0, 1], layers_pattern="["),
        ["'layers_pattern'", "refused"],
    ),
    ("target_lookaround", lambda d: _edit_config(d, target_modules="(?=.*q).*_proj"), ["'target_modules'", "look"]),
    ("exclude_not_strings", lambda d: _edit_config(d, exclude_modules=[5]), ["'exclude_modules'"]),
]


def test_backtracking_patterns_match_in_linear_time(good_adapter: Path, base_cfg: ModelConfig, tmp_path: Path) -> None:
    """Patterns Python's ``re`` backtracks on for ever (``(.*)*\\.zzz`` against a module name;
    ``(a+)+$`` against a long name) are answered at once: the worker cannot be frozen."""
    from deltaserve.adapters.peft_regex import fullmatches

    assert fullmatches("(a+)+$", ["a" * 10_000 + "b", "aaa"], "field", ValueError) == [False, True]
    d = tmp_path / "evil"
    shutil.copytree(good_adapter, d)
    _edit_config(d, target_modules=r"(.*)*\.zzz")
    with pytest.raises(LoraAdapterError, match="matches none"):
        load_lora_adapter(d, base_cfg)
    _edit_config(d, target_modules=["q_proj", "v_proj", "down_proj"], exclude_modules=r"(.*)*\.zzz")
    load_lora_adapter(d, base_cfg)  # excludes nothing
    _edit_config(d, rank_pattern={r"(.*)*\.zzz": 4}, layers_to_transform=[0, 1], layers_pattern=r"(.*)*\.zzz")
    with pytest.raises(LoraAdapterError, match="'layers_pattern' does not match"):
        load_lora_adapter(d, base_cfg)


@pytest.mark.parametrize("make_bad,needles", [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_refusals(
    make_bad: Callable[[Path], None], needles: list[str], good_adapter: Path, base_cfg: ModelConfig, tmp_path: Path
) -> None:  # noqa: E501
    d = tmp_path / "bad"
    shutil.copytree(good_adapter, d)
    load_lora_adapter(d, base_cfg)  # the copy is good before the edit
    make_bad(d)
    with pytest.raises(LoraAdapterError) as err:
        load_lora_adapter(d, base_cfg)
    msg = str(err.value)
    assert isinstance(err.value, ValueError)
    assert str(d) in msg, msg
    for needle in needles:
        assert needle in msg, f"{needle!r} not in {msg!r}"


def test_overflow_on_requested_dtype(good_adapter: Path, base_cfg: ModelConfig, tmp_path: Path) -> None:
    d = tmp_path / "big"
    shutil.copytree(good_adapter, d)
    _edit_tensors(d, _poke(Q_A, 1e6))
    assert load_lora_adapter(d, base_cfg).dtype == torch.float32
    with pytest.raises(LoraAdapterError, match=rf"'{Q_A}' overflows torch.float16"):
        load_lora_adapter(d, base_cfg, dtype=torch.float16)


class _Tripwire:
    """Unpickling this touches a marker file: proof the loader never unpickles."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204
        return (pathlib.Path.touch, (self.marker,))


def test_pickle_only_is_refused_and_never_unpickled(good_adapter: Path, base_cfg: ModelConfig, tmp_path: Path) -> None:
    d = tmp_path / "pickled"
    shutil.copytree(good_adapter, d)
    (d / "adapter_model.safetensors").unlink()
    marker = tmp_path / "unpickled"
    (d / "adapter_model.bin").write_bytes(pickle.dumps(_Tripwire(marker)))
    with pytest.raises(LoraAdapterError) as err:
        load_lora_adapter(d, base_cfg)
    assert "adapter_model.bin" in str(err.value) and "pickle" in str(err.value) and str(d) in str(err.value)
    assert not marker.exists()
    pickle.loads((d / "adapter_model.bin").read_bytes())  # the tripwire works when unpickled
    assert marker.exists()


def test_adapter_summary(good_adapter: Path, base_cfg: ModelConfig) -> None:
    ad: LoraAdapter = load_lora_adapter(good_adapter, base_cfg)
    assert ad.target_modules == {"q_proj", "v_proj", "down_proj"}
    assert ad.layers == [0, 1] and ad.max_rank == 8 and ad.rank == 8 and ad.alpha == 16.0
    assert all(w.scaling == 2.0 for w in ad.modules.values())
    assert ad.features["down_proj"] == (128, 64) and ad.features["k_proj"] == (64, 32)
