"""The LoRA pool (``deltaserve.adapters.lora_pool``) on the tiny Llama, adapters made by ``peft``.

Everything goes through ``Executor.step`` plans carrying ``adapter_ops`` (as the router sends
them), then is checked against the pool's tensors:

- layout: pages needed equal an independent first-fit count; every rank row lies inside one
  region of the adapter's own pages; rows of two adapters never overlap; the offsets point at
  exactly the adapter's A rows and B columns in every layer (read back from the KV tensor), and
  the per-layer rank / scale tables follow ``rank_pattern``;
- inspect: footprint of good adapters; errors that name the dir and field, the rank limit
  (``--max-lora-rank``) and rows wider than a page half (``--block-size``); it changes nothing;
- tiers: host bytes while loading and after, ``drop_host`` keeps a GPU placement, a load that
  failed quarantines its variant at ``to_gpu`` (``failed_variants``, no path in the message; the
  log names the dir and tensor);
- the adapted linears add exactly ``lora_delta_ref`` per token (SGMV and MBGMV metadata), an
  adapter dropped and re-placed on other pages gives identical outputs, and KV written into the
  pages of a dropped adapter leaves another resident adapter's outputs unchanged.
"""

from __future__ import annotations

import gc
import json
import logging
import random
import re
import shutil
import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from deltaserve import wire
from deltaserve.adapters import AdapterLoadError, DeltaLinear, LoraLinear, load_lora_adapter, lora_delta_ref
from deltaserve.adapters.pinned_arena import ALIGN, slack_for
from deltaserve.model.decoder import linear_slots
from deltaserve.worker import executor as executor_module
from deltaserve.worker.executor import Executor

peft = pytest.importorskip("peft")
from helpers.peft_adapters import SEVEN, make_peft_adapter  # noqa: E402

KV_BYTES = 2 << 20
SPECS = {
    "qv": dict(target_modules=["q_proj", "v_proj"], r=8, lora_alpha=16),
    "all": dict(target_modules=SEVEN, r=16, lora_alpha=8, use_rslora=True),
    # q is rank 12 in layer 0 and 4 in layer 1 (rows 4..11 unused there); down is rank 6.
    "pattern": dict(
        target_modules=["q_proj", "up_proj", "down_proj"],
        r=4,
        lora_alpha=6,
        rank_pattern={"layers.0.self_attn.q_proj": 12, "down_proj": 6},
    ),
}


@pytest.fixture(scope="module")
def dirs(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pool_adapters")
    return {
        name: make_peft_adapter(tiny_llama, root / name, seed=20 + i, **kw)[1]
        for i, (name, kw) in enumerate(SPECS.items())
    }


@pytest.fixture(scope="module")
def make_executor(tiny_llama: Path):
    def make(**kw) -> Executor:
        kw.setdefault("kv_cache_bytes", KV_BYTES)
        kw.setdefault("block_size", 4)
        return Executor(tiny_llama, device="cpu", dtype="float32", **kw)

    return make


_step_ids = iter(range(1, 1 << 30))


def ops(ex: Executor, *adapter_ops: wire.VariantOp) -> wire.StepOutput:
    return ex.step(wire.StepPlan(step_id=next(_step_ids), adapter_ops=list(adapter_ops)))


def place(ex: Executor, aid: int, path: Path, pages: list[int]) -> None:
    ops(ex, wire.VariantOp(aid, wire.TierOp.TO_HOST, str(path), []), wire.VariantOp(aid, wire.TierOp.TO_GPU, "", pages))


def first_fit_pages(adapter, features, order, region: int) -> int:
    """Pages the spec's first-fit needs, computed here independently of the pool."""
    ranks: dict[str, int] = {}
    for (_, proj), w in adapter.modules.items():
        ranks[proj] = max(ranks.get(proj, 0), w.rank)
    regions, off = 1, 0
    for proj in order:
        fin, fout = features[proj]
        for width in [fin] * ranks.get(proj, 0) + [fout] * ranks.get(proj, 0):
            if off + width > region:
                regions, off = regions + 1, 0
            off += width
    return -(-regions // 2)


def test_layout_rows_inside_own_pages_and_offsets_point_at_the_weights(make_executor, dirs) -> None:
    ex = make_executor()
    pool, cfg = ex.lora_pool, ex.config
    S, NB = pool.region_elems, ex.kv.num_blocks
    free = list(range(ex.num_blocks))
    random.Random(1).shuffle(free)
    loaded, pages_of, intervals = {}, {}, []
    for aid, name in enumerate(SPECS, start=1):
        ad = load_lora_adapter(dirs[name], cfg)
        loaded[aid] = ad
        info = ex.inspect_variant(str(dirs[name]))
        assert info.error is None
        assert info.num_blocks == first_fit_pages(ad, pool.features, pool.order, S)
        assert info.max_rank == ad.max_rank and set(info.target_modules) == set(ad.target_modules)
        pages_of[aid] = [free.pop() for _ in range(info.num_blocks)]
        place(ex, aid, dirs[name], pages_of[aid])
    assert loaded[3].modules[(0, "q_proj")].rank == 12 and loaded[3].modules[(1, "q_proj")].rank == 4

    for aid, ad in loaded.items():
        g = pool.gpu[aid]
        assert g.block_ids == tuple(pages_of[aid])
        for i, proj in enumerate(pool.order):
            fin, fout = pool.features[proj]
            r_p = max((w.rank for (_, p), w in ad.modules.items() if p == proj), default=0)
            for layer in range(cfg.num_layers):
                w = ad.modules.get((layer, proj))
                assert int(g.rank[layer, i]) == (w.rank if w else 0)
                assert float(g.scale[layer, i]) == pytest.approx(w.scaling if w else 0.0)
            for j in range(r_p):
                for off, dim in ((int(g.a_off[i, j]), fin), (int(g.b_off[i, j]), fout)):
                    half, page = divmod(off // S, NB)
                    assert page in pages_of[aid] and off % S + dim <= S, (aid, proj, j)
                    intervals.append((off, off + dim, aid))
            flat = ex.kv.kv.view(cfg.num_layers, -1)
            for layer in range(cfg.num_layers):
                w = ad.modules.get((layer, proj))
                for j in range(w.rank if w else 0):
                    a0, b0 = int(g.a_off[i, j]), int(g.b_off[i, j])
                    assert torch.equal(flat[layer, a0 : a0 + fin], w.a[j]), (aid, layer, proj, j)
                    assert torch.equal(flat[layer, b0 : b0 + fout], w.b[:, j]), (aid, layer, proj, j)
    intervals.sort()
    for (_, e0, a0), (s1, _, a1) in zip(intervals, intervals[1:]):
        assert e0 <= s1, f"rows of adapters {a0} and {a1} overlap at {s1}"
    assert {a for _, _, a in intervals} == set(loaded)


def test_inspect_reports_footprint_and_errors_and_changes_nothing(make_executor, dirs, tmp_path: Path) -> None:
    ex = make_executor()
    cfg = ex.config
    info = ex.inspect_variant(str(dirs["qv"]))
    # q and v, rank 8: 8 A rows of 64 + 8 B^T rows of (64 for q, 32 for v), per layer, float32.
    slots = linear_slots(cfg)
    per_layer = 8 * (cfg.hidden_size + slots["q_proj"].size) + 8 * (cfg.hidden_size + slots["v_proj"].size)
    assert info.host_bytes == cfg.num_layers * per_layer * 4
    assert (info.max_rank, info.target_modules) == (8, ["q_proj", "v_proj"])

    missing = tmp_path / "gone"
    assert str(missing) in ex.inspect_variant(str(missing)).error
    dora = tmp_path / "dora"
    shutil.copytree(dirs["qv"], dora)
    conf = json.loads((dora / "adapter_config.json").read_text())
    conf["use_dora"] = True
    (dora / "adapter_config.json").write_text(json.dumps(conf))
    err = ex.inspect_variant(str(dora)).error
    assert "dora" in err and "use_dora" in err
    # Values are checked too (by the native reader the host tier packs with), without loading them.
    nan = tmp_path / "nan"
    shutil.copytree(dirs["qv"], nan)
    tensors = load_file(nan / "adapter_model.safetensors")
    key = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
    tensors[key][5, 3] = float("nan")
    save_file(tensors, nan / "adapter_model.safetensors")
    err = ex.inspect_variant(str(nan)).error
    assert str(nan) in err and f"'{key}' contains non-finite values" in err and "[5, 3]" in err

    low = make_executor(max_lora_rank=8)
    err = low.inspect_variant(str(dirs["all"])).error
    assert "--max-lora-rank 8" in err and "rank 16" in err and str(dirs["all"]) in err
    assert low.inspect_variant(str(dirs["qv"])).error is None  # rank 8 fits exactly

    # block_size 1: a page half holds 1 x 2 kv heads x 16 = 32 elements, a q row has 64.
    narrow = make_executor(block_size=1)
    err = narrow.inspect_variant(str(dirs["qv"])).error
    assert "raise --block-size" in err and "q_proj" in err and "32" in err

    assert len(ex.lora_pool.host) == 0 and ex.lora_pool.gpu == {} and ex.variant_host_bytes == 0
    off = make_executor(max_lora_rank=0)
    assert off.lora_pool is None and "--max-lora-rank 0" in off.inspect_variant(str(dirs["qv"])).error


def assert_load_fails(ex: Executor, aid: int, caplog: pytest.LogCaptureFixture, logged: str) -> None:
    """The ``to_gpu`` of adapter ``aid`` fails its variant alone: the step reports it in
    ``failed_variants`` with a message free of server paths, nothing is placed, and the worker's log
    says why (``logged``, a regex: the path and the tensor)."""
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="deltaserve.worker.quarantine"):
        out = ops(ex, wire.VariantOp(aid, wire.TierOp.TO_GPU, "", [0, 1, 2]))
    assert [f.variant_id for f in out.failed_variants] == [aid]
    message = out.failed_variants[0].message
    assert "could not be loaded" in message and "/" not in message, message
    assert aid not in ex.lora_pool.gpu and aid not in ex.lora_pool.host
    assert any(re.search(logged, r.getMessage()) for r in caplog.records), caplog.text


def test_host_and_gpu_tiers(make_executor, dirs, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ex = make_executor()
    size = {n: ex.inspect_variant(str(dirs[n])).host_bytes for n in ("qv", "all")}
    out = ops(
        ex,
        wire.VariantOp(1, wire.TierOp.TO_HOST, str(dirs["qv"]), []),
        wire.VariantOp(2, wire.TierOp.TO_HOST, str(dirs["all"]), []),
    )
    assert out.adapter_host_bytes == size["qv"] + size["all"]  # counted while loading, too
    ex.lora_pool.wait_host(1), ex.lora_pool.wait_host(2)
    assert ex.variant_host_bytes == size["qv"] + size["all"]
    out2 = ops(ex, wire.VariantOp(1, wire.TierOp.DROP_HOST, "", []))
    assert out2.adapter_host_bytes == size["all"]
    # Finished reads are reported once each (in the output after they finish), a dropped one never
    # after its drop: the router admits requests for adapter 2 without stalling a step on its read.
    assert set(out.host_ready) <= {1, 2} and set(out2.host_ready) <= {2}
    assert sorted(out.host_ready + out2.host_ready) in ([1, 2], [2])

    # A GPU placement outlives its host copy.
    n = ex.inspect_variant(str(dirs["all"])).num_blocks
    ops(
        ex,
        wire.VariantOp(2, wire.TierOp.TO_GPU, "", list(range(10, 10 + n))),
        wire.VariantOp(2, wire.TierOp.DROP_HOST, "", []),
    )
    assert ex.variant_host_bytes == 0 and set(ex.lora_pool.gpu) == {2}
    assert set(ex.lora_pool.page_owner) == set(range(10, 10 + n))

    # A directory that vanished after registration: the load fails in the background, to_gpu raises.
    gone = tmp_path / "vanishing"
    shutil.copytree(dirs["qv"], gone)
    assert ex.inspect_variant(str(gone)).error is None
    shutil.rmtree(gone)
    ops(ex, wire.VariantOp(3, wire.TierOp.TO_HOST, str(gone), []))
    with pytest.raises(AdapterLoadError, match="vanishing"):
        ex.lora_pool.wait_host(3)
    assert ex.variant_host_bytes == 0
    assert ops(ex).host_ready == [3], "a failed read is reported too: its to_gpu says why"
    assert_load_fails(ex, 3, caplog, r"adapter 3: loading .*vanishing")
    assert set(ex.lora_pool.gpu) == {2}

    # Values changed after registration: the background read refuses them, naming the tensor.
    spoiled = tmp_path / "spoiled"
    shutil.copytree(dirs["qv"], spoiled)
    assert ex.inspect_variant(str(spoiled)).error is None
    tensors = load_file(spoiled / "adapter_model.safetensors")
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    tensors[key][0, 0] = float("inf")
    save_file(tensors, spoiled / "adapter_model.safetensors")
    ops(ex, wire.VariantOp(4, wire.TierOp.TO_HOST, str(spoiled), []))
    assert_load_fails(ex, 4, caplog, rf"adapter 4: loading .*spoiled.*'{re.escape(key)}' contains non-finite")

    # Loads follow the plan registration made (no config or header parsing on the loader threads):
    # a config deleted since is served as registered; weights of another shape are refused by name.
    replanned = tmp_path / "replanned"
    shutil.copytree(dirs["qv"], replanned)
    assert ex.inspect_variant(str(replanned)).error is None
    (replanned / "adapter_config.json").unlink()
    ops(ex, wire.VariantOp(5, wire.TierOp.TO_HOST, str(replanned), []))
    assert ex.lora_pool.wait_host(5).packed.shape == (
        ex.config.num_layers,
        ex.lora_pool.plans[str(replanned)].layout.packed_elems,
    )
    tensors = load_file(replanned / "adapter_model.safetensors")
    tensors[key] = torch.zeros(4, tensors[key].shape[1])  # rank 8 -> 4
    save_file(tensors, replanned / "adapter_model.safetensors")
    ops(
        ex, wire.VariantOp(5, wire.TierOp.DROP_HOST, "", []), wire.VariantOp(6, wire.TierOp.TO_HOST, str(replanned), [])
    )
    assert_load_fails(ex, 6, caplog, rf"adapter 6: .*'{re.escape(key)}' has shape \[4, 64\], expected \[8, 64\]")


def test_host_copies_come_from_the_arena_and_go_back(
    make_executor, dirs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``host_arena_bytes`` the host copies are carved from one arena (pinned on CUDA): the same
    bytes as copies allocated on their own, rows past a smaller rank zeroed even in reused memory, a
    copy that does not fit allocated on its own, and the memory of dropped or failed reads reusable.
    The arena is the host budget plus ``slack_for`` it (here without, to run it full)."""
    assert make_executor(host_arena_bytes=1 << 20).lora_pool.arena.capacity == (1 << 20) + slack_for(1 << 20)
    monkeypatch.setattr(executor_module, "slack_for", lambda budget: 0)
    ref = make_executor()
    size = {n: ref.inspect_variant(str(dirs[n])).host_bytes for n in SPECS}
    ops(ref, *(wire.VariantOp(i, wire.TierOp.TO_HOST, str(dirs[n]), []) for i, n in enumerate(SPECS, start=1)))
    want = {n: ref.lora_pool.wait_host(i).packed for i, n in enumerate(SPECS, start=1)}

    aligned = {n: -(-b // ALIGN) * ALIGN for n, b in size.items()}
    ex = make_executor(host_arena_bytes=aligned["pattern"] + aligned["all"])
    arena = ex.lora_pool.arena
    assert arena is not None and not arena.pinned, "pinned only on CUDA"
    ops(ex, wire.VariantOp(1, wire.TierOp.TO_HOST, str(dirs["pattern"]), []))
    first = ex.lora_pool.wait_host(1).packed
    assert arena.owns(first) and torch.equal(first, want["pattern"])
    ops(ex, wire.VariantOp(1, wire.TierOp.DROP_HOST, "", []))
    assert arena.free_bytes == arena.capacity
    first.fill_(float("nan"))  # what a reused region holds before the next read
    ops(ex, wire.VariantOp(2, wire.TierOp.TO_HOST, str(dirs["pattern"]), []))
    again = ex.lora_pool.wait_host(2).packed  # best fit: the region just given back (all of the arena)
    ops(ex, wire.VariantOp(3, wire.TierOp.TO_HOST, str(dirs["all"]), []))
    assert again.data_ptr() == first.data_ptr() and torch.equal(again, want["pattern"]), "unused rows not zeroed"
    assert arena.owns(ex.lora_pool.wait_host(3).packed) and torch.equal(ex.lora_pool.wait_host(3).packed, want["all"])
    assert arena.free_bytes == 0
    ops(ex, wire.VariantOp(4, wire.TierOp.TO_HOST, str(dirs["qv"]), []))  # no room left: allocated on its own
    own = ex.lora_pool.wait_host(4).packed
    assert not arena.owns(own) and torch.equal(own, want["qv"])
    assert ex.variant_host_bytes == size["pattern"] + size["all"] + size["qv"]

    # A read that fails gives its region back; the placement of an arena copy is the same as ``ref``'s.
    ops(ex, wire.VariantOp(3, wire.TierOp.DROP_HOST, "", []))
    gone = tmp_path / "vanishing"
    shutil.copytree(dirs["all"], gone)
    assert ex.inspect_variant(str(gone)).error is None
    (gone / "adapter_model.safetensors").write_bytes(b"")
    ops(ex, wire.VariantOp(5, wire.TierOp.TO_HOST, str(gone), []))
    with pytest.raises(AdapterLoadError):
        ex.lora_pool.wait_host(5)
    assert arena.free_bytes == aligned["all"]
    n = ex.inspect_variant(str(dirs["pattern"])).num_blocks
    ops(ex, wire.VariantOp(2, wire.TierOp.TO_GPU, "", list(range(n))))
    ops(ref, wire.VariantOp(3, wire.TierOp.TO_GPU, "", list(range(n))))
    assert torch.equal(ex.kv.kv, ref.kv.kv)


def test_a_dropped_executor_frees_its_pool_at_once(make_executor, dirs) -> None:
    """No reference cycle through the host tier's release hook: a dropped executor's adapter pool (and
    the KV pool's device memory it views) goes at once, not at the next cyclic garbage collection
    (benchmarks build one executor after another on one GPU)."""
    ex = make_executor(host_arena_bytes=1 << 20)
    n = ex.inspect_variant(str(dirs["qv"])).num_blocks
    place(ex, 1, dirs["qv"], list(range(n)))
    ops(ex, wire.VariantOp(1, wire.TierOp.DROP_HOST, "", []))  # through the release hook
    pool = weakref.ref(ex.lora_pool)
    gc.disable()
    try:
        del ex
        assert pool() is None, "the adapter pool outlived its executor"
    finally:
        gc.enable()


# ------------------------------------------------------------------------------ adapted linears


def _modules(ex: Executor) -> list[tuple[int, str, LoraLinear, list[str]]]:
    out = []
    for layer, block in enumerate(ex.model.model.layers):
        for path, projs in (
            ("self_attn.qkv_proj", ["q_proj", "k_proj", "v_proj"]),
            ("self_attn.o_proj", ["o_proj"]),
            ("mlp.gate_up_proj", ["gate_proj", "up_proj"]),
            ("mlp.down_proj", ["down_proj"]),
        ):
            mod = block.get_submodule(path)
            if isinstance(mod, DeltaLinear):  # deltas on (the default) wrap the LoRA linear
                mod = mod.inner
            assert isinstance(mod, LoraLinear)
            out.append((layer, path, mod, projs))
    return out


def _run_all(
    ex: Executor, segments, decode: bool, seed: int = 0
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """Every adapted linear on a random x under the step ``segments``: (x, output) per module."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(n for _, n in segments)
    assert ex.lora_pool.begin_segments(segments, decode)
    try:
        res = {}
        for layer, path, mod, _ in _modules(ex):
            x = torch.randn(total, mod.in_features, generator=gen)
            res[(layer, path)] = (x, mod(x))
        return res
    finally:
        ex.lora_pool.end_step()


def _check_deltas(ex: Executor, res, token_adapter: list[int], loaded) -> None:
    slots = linear_slots(ex.config)
    for layer, path, mod, projs in _modules(ex):
        x, got = res[(layer, path)]
        want = torch.nn.functional.linear(x, mod.weight, mod.bias)
        for t, aid in enumerate(token_adapter):
            if aid:
                for proj in projs:
                    s = slots[proj]
                    want[t, s.start : s.start + s.size] += lora_delta_ref(loaded[aid], layer, proj, x[t : t + 1])[0]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_linears_add_each_tokens_delta_and_survive_replacement_and_kv_writes(make_executor, dirs) -> None:
    ex = make_executor(max_loras_per_step=3)
    cfg = ex.config
    names = {1: "qv", 2: "all", 3: "pattern"}
    loaded = {aid: load_lora_adapter(dirs[n], cfg) for aid, n in names.items()}
    need = {aid: ex.inspect_variant(str(dirs[n])).num_blocks for aid, n in names.items()}
    free = list(range(ex.num_blocks))
    random.Random(3).shuffle(free)
    pages = {aid: [free.pop() for _ in range(need[aid])] for aid in names}
    for aid, n in names.items():
        place(ex, aid, dirs[n], pages[aid])

    # Inactive: every adapted linear is exactly its base.
    x = torch.randn(3, cfg.hidden_size)
    qkv = ex.model.model.layers[0].self_attn.qkv_proj
    assert not ex.lora_pool.step.active
    assert torch.equal(qkv(x), torch.nn.functional.linear(x, qkv.weight, qkv.bias))
    assert not ex.lora_pool.begin_segments([(0, 4)], False) and not ex.lora_pool.step.active

    prefill = [(0, 2), (1, 3), (3, 2), (2, 1), (1, 1)]  # adapter 1's tokens in two runs
    prefill_tokens = [a for a, n in prefill for _ in range(n)]
    decode = [(2, 1), (0, 1), (3, 1), (1, 1), (3, 1)]
    decode_tokens = [a for a, _ in decode]
    before_prefill = _run_all(ex, prefill, False, seed=1)
    _check_deltas(ex, before_prefill, prefill_tokens, loaded)
    before_decode = _run_all(ex, decode, True, seed=2)
    _check_deltas(ex, before_decode, decode_tokens, loaded)
    # Adapter 3 (rank_pattern) really changes q in layer 0 with its 12 rows.
    x0, got0 = before_prefill[(0, "self_attn.qkv_proj")]
    assert not torch.equal(got0[5:7], torch.nn.functional.linear(x0[5:7], qkv.weight, qkv.bias))

    # Drop adapter 1 and put it on other pages: identical outputs.
    new_pages = [free.pop() for _ in range(need[1])]
    assert not set(new_pages) & set(pages[1])
    ops(ex, wire.VariantOp(1, wire.TierOp.DROP_GPU, "", []), wire.VariantOp(1, wire.TierOp.DROP_HOST, "", []))
    place(ex, 1, dirs["qv"], new_pages)
    for segs, is_decode, seed, before in ((prefill, False, 1, before_prefill), (decode, True, 2, before_decode)):
        after = _run_all(ex, segs, is_decode, seed=seed)
        assert all(torch.equal(after[k][1], before[k][1]) for k in before)

    # Drop adapter 3 and scribble "KV" over its pages: 1 and 2 are unaffected.
    ops(ex, wire.VariantOp(3, wire.TierOp.DROP_GPU, "", []))
    ex.kv.kv[:, :, pages[3]] = torch.randn_like(ex.kv.kv[:, :, pages[3]])
    only12 = [(0, 2), (1, 3), (2, 2), (1, 1)]
    ref = _run_all(ex, only12, False, seed=4)
    _check_deltas(ex, ref, [a for a, n in only12 for _ in range(n)], loaded)

    # Slots: at most max_loras_per_step (3) distinct adapters per step, reused while resident.
    slot_before = dict(ex.lora_pool.slot_of)
    _run_all(ex, [(2, 1), (1, 1)], True)
    assert ex.lora_pool.slot_of == slot_before and 3 not in ex.lora_pool.slot_of
    ops(ex, wire.VariantOp(3, wire.TierOp.TO_GPU, "", pages[3]))  # its host copy is still there
    _check_deltas(ex, _run_all(ex, prefill, False, seed=5), prefill_tokens, loaded)
    with pytest.raises(ValueError, match="not on the GPU"):
        ex.lora_pool.begin_segments([(9, 1)], True)
    assert not ex.lora_pool.step.active


def test_one_slot_is_refilled_as_steps_alternate_adapters(make_executor, dirs) -> None:
    ex = make_executor(max_loras_per_step=1)
    loaded = {1: load_lora_adapter(dirs["qv"], ex.config), 2: load_lora_adapter(dirs["all"], ex.config)}
    place(ex, 1, dirs["qv"], list(range(0, ex.inspect_variant(str(dirs["qv"])).num_blocks)))
    place(ex, 2, dirs["all"], list(range(100, 100 + ex.inspect_variant(str(dirs["all"])).num_blocks)))
    for step, aid in enumerate([1, 2, 2, 1]):
        segs = [(0, 1), (aid, 2)]
        _check_deltas(ex, _run_all(ex, segs, False, seed=step), [0, aid, aid], loaded)
        assert ex.lora_pool.slot_of == {aid: 0}
    with pytest.raises(ValueError, match="--max-loras-per-step 1"):
        ex.lora_pool.begin_segments([(1, 1), (2, 1)], True)


def test_triton_kernels_over_the_pool_match_the_reference(make_executor, dirs) -> None:
    """The same step tables through the Triton kernels (interpreted on CPU; small r_max to stay fast)."""
    from deltaserve.kernels import common as kernel_common

    ex = make_executor(max_lora_rank=16, max_loras_per_step=2)
    loaded = {1: load_lora_adapter(dirs["qv"], ex.config), 2: load_lora_adapter(dirs["all"], ex.config)}
    place(ex, 1, dirs["qv"], list(range(0, ex.inspect_variant(str(dirs["qv"])).num_blocks)))
    place(ex, 2, dirs["all"], list(range(200, 200 + ex.inspect_variant(str(dirs["all"])).num_blocks)))
    previous = kernel_common.set_backend("triton")
    try:
        prefill = _run_all(ex, [(1, 2), (0, 1), (2, 3)], False, seed=6)
        decode = _run_all(ex, [(2, 1), (0, 1), (1, 1)], True, seed=7)
    finally:
        kernel_common.set_backend(previous)
    _check_deltas(ex, prefill, [1, 1, 0, 2, 2, 2], loaded)
    _check_deltas(ex, decode, [2, 0, 1], loaded)
