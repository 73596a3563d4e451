"""Serving LoRA adapters registered at start-up: ``attach_lora`` + the executor, against PEFT itself.

Two adapters made by the ``peft`` library on the tiny Llama (non-zero random A and B, so each
visibly changes the output): A = rank 8 on q, v (alpha 16); B = rank 16 on all seven projections
with rsLoRA (alpha 8). Checked:

- ``LoraLinear`` adds exactly ``lora_delta_ref`` into each adapted slice of a fused projection, per
  token; an inactive step is bit-identical to the plain model;
- through the executor (plans built by test_executor's MiniRouter, with ``adapter_id`` set on the
  NewRequests), greedy tokens for A / B equal HF ``generate`` on PEFT's ``merge_and_unload()``,
  and base requests equal plain HF;
- a mixed batch (base, A, B interleaved, 12 requests of different lengths, chunked prefill,
  staggered arrivals, one preemption) gives each request exactly its tokens alone;
- an unknown ``adapter_id`` is a PlanError that changes nothing; a bad adapter dir fails start-up
  naming the dir; ``--loras`` parsing and its refusals.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from deltaserve import wire
from deltaserve.adapters import LoraAdapterError, LoraLinear, attach_lora, load_lora_adapter, lora_delta_ref
from deltaserve.model.decoder import linear_slots
from deltaserve.model.loader import load_model
from deltaserve.worker.config import ConfigError, WorkerConfig
from deltaserve.worker.executor import Executor, PlanError
from deltaserve.worker.loop import traceback_summary

peft = pytest.importorskip("peft")
from test_executor import GREEDY, KV_BYTES, MiniRouter, hf_greedy, prompts  # noqa: E402
from helpers.peft_adapters import SEVEN, make_peft_adapter  # noqa: E402

ADAPTER_A = dict(target_modules=["q_proj", "v_proj"], r=8, lora_alpha=16)
ADAPTER_B = dict(target_modules=SEVEN, r=16, lora_alpha=8, use_rslora=True)


class AdapterRouter(MiniRouter):
    """MiniRouter whose NewRequests carry ``adapter_of[req_id]`` (0 when absent), as the router sends them."""

    def __init__(self, executor: Executor, adapter_of: dict[int, int], **kw) -> None:
        super().__init__(executor, **kw)
        self.adapter_of = adapter_of

    def plan(self) -> wire.StepPlan:
        plan = super().plan()
        for new in plan.new_requests:
            new.adapter_id = self.adapter_of.get(new.req_id, 0)
        return plan


@pytest.fixture(scope="module")
def adapters(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, tuple[Path, torch.nn.Module]]:
    """Adapter id -> (PEFT dir, HF model with that adapter merged)."""
    root = tmp_path_factory.mktemp("lora_serving")
    out = {}
    for adapter_id, (name, kw) in {1: ("a", ADAPTER_A), 2: ("b", ADAPTER_B)}.items():
        pm, adir = make_peft_adapter(tiny_llama, root / name, seed=10 + adapter_id, **kw)
        out[adapter_id] = (adir, pm.merge_and_unload().eval())
    return out


@pytest.fixture(scope="module")
def make_executor(tiny_llama: Path, adapters):
    def make(**kw) -> Executor:
        kw.setdefault("kv_cache_bytes", KV_BYTES)
        kw.setdefault("loras", {i: d for i, (d, _) in adapters.items()})
        return Executor(tiny_llama, device="cpu", dtype="float32", block_size=4, **kw)

    return make


@pytest.fixture(scope="module")
def hf_base(tiny_llama: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


def test_lora_linear_adds_each_tokens_adapter_delta(tiny_llama: Path, adapters) -> None:
    model = load_model(tiny_llama, "cpu", torch.float32)
    cfg = model.config
    loaded = {i: load_lora_adapter(d, cfg) for i, (d, _) in adapters.items()}
    plain = {n: p.clone() for n, p in model.named_parameters()}
    state_keys = list(model.state_dict())
    step = attach_lora(model, loaded)
    # Weights stay where they were: same names, same tensors, same HF state_dict view.
    assert {n: p for n, p in model.named_parameters()}.keys() == plain.keys()
    assert all(torch.equal(p, plain[n]) for n, p in model.named_parameters())
    assert list(model.state_dict()) == state_keys
    layer0 = model.model.layers[0]
    # A targets q, v only (qkv); B targets all seven: every module of the layer is wrapped.
    for mod in (layer0.self_attn.qkv_proj, layer0.self_attn.o_proj, layer0.mlp.gate_up_proj, layer0.mlp.down_proj):
        assert isinstance(mod, LoraLinear)
    assert sorted(layer0.self_attn.qkv_proj.factors) == [0, 1] and sorted(layer0.self_attn.o_proj.factors) == [1]

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, cfg.hidden_size, generator=gen)
    qkv = layer0.self_attn.qkv_proj
    base_out = F.linear(x, qkv.weight, qkv.bias)
    assert torch.equal(qkv(x), base_out)  # inactive step: the base alone

    # Tokens: base x2, A x3, B x1, A x1 (adapter A's rows are not contiguous).
    segments = [(0, 2), (1, 3), (2, 1), (1, 1)]
    token_adapter = [0, 0, 1, 1, 1, 2, 1]
    step.set_segments(segments)
    try:
        got = qkv(x)
    finally:
        step.clear()
    slots = linear_slots(cfg)
    expected = base_out.clone()
    for t, adapter_id in enumerate(token_adapter):
        if adapter_id == 0:
            continue
        for proj in ("q_proj", "k_proj", "v_proj"):
            s = slots[proj]
            expected[t, s.start : s.start + s.size] += lora_delta_ref(loaded[adapter_id], 0, proj, x[t : t + 1])[0]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # A adapts no k_proj: base tokens and A tokens keep the base's k rows exactly.
    k = slots["k_proj"]
    assert torch.equal(got[:5, k.start : k.start + k.size], base_out[:5, k.start : k.start + k.size])
    assert not torch.equal(got[5, k.start : k.start + k.size], base_out[5, k.start : k.start + k.size])
    with pytest.raises(KeyError, match="adapter id 9"):
        step.set_segments([(9, 1)])
    with pytest.raises(ValueError, match="already has LoRA"):
        attach_lora(model, loaded)


def test_greedy_matches_peft_merged_and_base_matches_hf(make_executor, adapters, hf_base) -> None:
    ex = make_executor()
    ps = prompts(3, ex.config.vocab_size, seed=3, lo=3, hi=20)
    refs = {0: hf_base, **{i: merged for i, (_, merged) in adapters.items()}}
    outputs: dict[int, list[list[int]]] = {}
    for adapter_id, ref in refs.items():
        for j, prompt in enumerate(ps):
            rid = 100 * adapter_id + j
            got = AdapterRouter(ex, {rid: adapter_id}).run({rid: (prompt, 10)})[rid]
            assert got == hf_greedy(ref, prompt, 10), (adapter_id, j)
            outputs.setdefault(adapter_id, []).append(got)
    # The adapters change the output (so the comparisons above could fail).
    assert outputs[1] != outputs[0] and outputs[2] != outputs[0] and outputs[1] != outputs[2]


def test_mixed_batch_matches_each_alone(make_executor) -> None:
    ex = make_executor()
    ps = prompts(12, ex.config.vocab_size, seed=7, lo=2, hi=30)
    adapter_of = {i: i % 3 for i in range(12)}  # base, A, B interleaved
    max_new = {i: 4 + i % 6 for i in range(12)}
    alone = {i: AdapterRouter(ex, adapter_of).run({i: (p, max_new[i])})[i] for i, p in enumerate(ps)}

    ex2 = make_executor()
    router = AdapterRouter(ex2, adapter_of, chunk=9, seed=5)
    reqs = {i: (p, max_new[i]) for i, p in enumerate(ps)}
    arrivals = {i: i // 3 for i in range(12)}
    pending, steps, preempted = dict(reqs), 0, False
    added = {}
    while pending or router.active:
        for rid in [r for r in pending if arrivals[r] <= steps]:
            prompt, n = pending.pop(rid)
            added[rid] = router.add(rid, prompt, n)
        if not preempted and 5 in router.active and len(router.active[5].outputs) == 2:
            router.preempt(5)  # comes back as a NewRequest: it must keep adapter B
            preempted = True
        if router.active:
            router.step()
        steps += 1
        assert steps < 1000
    done = {rid: r.outputs for rid, r in added.items()}
    assert preempted
    assert done == alone


def test_unknown_adapter_is_a_plan_error_and_changes_nothing(make_executor) -> None:
    ex = make_executor()
    router = AdapterRouter(ex, {1: 2})
    router.add(1, [4, 5, 6, 7], 20)
    router.step()
    before = copy.deepcopy(ex.requests)
    assert before[1].adapter_id == 2
    pool = ex.num_blocks
    bad = wire.NewRequest(req_id=2, token_ids=[3, 4, 5], num_prompt_tokens=3, num_computed_tokens=0,
                          num_scheduled_tokens=3, block_ids=[pool - 1], sampling=GREEDY, adapter_id=7)
    good = router.plan()  # request 1's next decode step, with the pages it needs
    with pytest.raises(PlanError, match=r"adapter_id 7 is not loaded .*loaded: 1, 2") as info:
        ex.step(wire.StepPlan(step_id=good.step_id, new_requests=[bad], running=good.running, released=[]))
    assert info.value.req_ids == [2]
    assert ex.requests == before
    # Without adapters, any non-zero id is refused.
    plain = make_executor(loras=None)
    assert plain.lora_step is None and plain.adapters == {}
    with pytest.raises(PlanError, match=r"adapter_id 1 is not loaded .*loaded: none"):
        plain.step(wire.StepPlan(step_id=1, new_requests=[bad.__class__(**{**_fields(bad), "adapter_id": 1})]))
    assert plain.requests == {}
    # The good plan still works afterwards, and request 1 keeps its adapter.
    out = ex.step(good)
    router.apply(out)
    assert out.outputs[0].req_id == 1 and out.outputs[0].token_id is not None
    assert ex.requests[1].adapter_id == 2


def _fields(msg: wire.NewRequest) -> dict:
    return {name: getattr(msg, name) for name in msg.__slots__}


def test_bad_adapter_dir_fails_start_naming_it(make_executor, adapters, tmp_path: Path) -> None:
    missing = tmp_path / "no-such-adapter"
    with pytest.raises(LoraAdapterError, match="no-such-adapter") as info:
        make_executor(loras={1: adapters[1][0], 3: missing})
    assert str(missing) in traceback_summary(info.value)  # what the loop sends as the fatal WorkerError
    # A PEFT dir whose config asks for something unsupported: refused at start with dir and field.
    dora = tmp_path / "dora"
    dora.mkdir()
    src = adapters[1][0]
    cfg = json.loads((src / "adapter_config.json").read_text())
    cfg["use_dora"] = True
    (dora / "adapter_config.json").write_text(json.dumps(cfg))
    (dora / "adapter_model.safetensors").write_bytes((src / "adapter_model.safetensors").read_bytes())
    with pytest.raises(LoraAdapterError, match=r"dora.*use_dora"):
        make_executor(loras={2: dora})
    with pytest.raises(ValueError, match="adapter id 0"):
        make_executor(loras={0: src})


def test_loras_flag(tiny_llama: Path, adapters, tmp_path: Path) -> None:
    base = ["--model", str(tiny_llama), "--ipc-dir", str(tmp_path)]
    dir_a, dir_b = adapters[1][0], adapters[2][0]
    cfg = WorkerConfig.from_args(base + ["--loras", json.dumps({"1": str(dir_a), "7": str(dir_b)})])
    assert cfg.lora_dirs() == {1: dir_a, 7: dir_b}
    assert WorkerConfig.from_args(base).lora_dirs() == {}
    bad = {
        "not json": "{1: x}",
        "not an object": json.dumps([str(dir_a)]),
        "id 0": json.dumps({"0": str(dir_a)}),
        "negative id": json.dumps({"-1": str(dir_a)}),
        "non-numeric id": json.dumps({"a": str(dir_a)}),
        "id beyond u32": json.dumps({str(2**32): str(dir_a)}),
        "missing dir": json.dumps({"1": str(tmp_path / "missing")}),
        "dir not a string": json.dumps({"1": 5}),
    }
    for name, value in bad.items():
        with pytest.raises(ConfigError, match="--loras") as info:
            WorkerConfig.from_args(base + ["--loras", value])
        assert info.type is ConfigError, name
