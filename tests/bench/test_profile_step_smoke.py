"""``bench/profile_step.py`` runs end to end in ``--smoke`` mode (CPU operators in place of kernels):
every case (decode steps, mixed steps, prefix-cache hits) is profiled, its time splits into kinds that add up to the total,
and each variant case is set against the base step of its batch and chunk."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import profile_step


def test_profile_step_smoke(tmp_path: Path) -> None:
    r = json.loads(profile_step.main(["--smoke", "--out", str(tmp_path)]).read_text())
    assert r["experiment"] == "profile_step" and r["mode"] == "eager" and r["device"] == "cpu"
    cases = {row["case"]: row for row in r["rows"]}
    hits = ("base-b0-c5-p16", "lora2-b0-c5-p16")
    assert set(cases) == {"base-b2", "delta2-b2", "lora2-b2", "base-b2-c5", "lora2-b2-c5", *hits}
    for row in cases.values():
        assert row["device_us_per_step"] > 0 and row["step_ms"] > 0 and row["kernels"]
        kinds = sum(k["us"] for k in row["by_kind"].values())
        assert kinds == pytest.approx(row["device_us_per_step"])
        assert sum(k["us"] for k in row["kernels"]) == pytest.approx(row["device_us_per_step"])
        assert row["floor_us"] >= 0 and (row["device_over_floor"] is None) == (row["floor_us"] == 0)
    assert "added_by_kind" not in cases["base-b2"] and "added_by_kind" not in cases["base-b2-c5"]
    pairs = (("delta2-b2", "base-b2"), ("lora2-b2", "base-b2"), ("lora2-b2-c5", "base-b2-c5"), hits[::-1])
    for name, base in pairs:
        row = cases[name]
        added = sum(row["added_by_kind"].values())
        assert added == pytest.approx(row["added_us"])
        assert row["added_us"] == pytest.approx(row["device_us_per_step"] - cases[base]["device_us_per_step"])
    # a mixed step answers the chunk's new request beside the decodes
    assert [cases[c]["chunk"] for c in ("base-b2", "base-b2-c5", "lora2-b2-c5")] == [0, 5, 5]
    assert [cases[c]["requests_per_step"] for c in ("base-b2", "base-b2-c5", "lora2-b2-c5")] == [2, 3, 3]
    # a prefix-cache hit alone: one request a step, behind 16 cached tokens
    assert [(cases[c]["requests_per_step"], cases[c]["cached_prefix"]) for c in hits] == [(1, 16), (1, 16)]


def test_profile_step_host_profile_smoke(tmp_path: Path) -> None:
    """``--host-profile``: the launching thread's Python functions per step instead of the kernels, sorted
    by own time, the forward's among them."""
    argv = ["--smoke", "--host-profile", "--out", str(tmp_path)]
    r = json.loads(profile_step.main(argv).read_text())
    assert r["source"].endswith("--host-profile")
    for row in r["rows"]:
        assert "kernels" not in row and row["step_ms"] > 0
        functions = row["host_functions"]
        own = [f["own_us"] for f in functions]
        assert own == sorted(own, reverse=True) and own[0] > 0
        assert all(f["cum_us"] >= f["own_us"] - 1e-6 and f["calls"] > 0 for f in functions)
        assert any("linear" in f["function"] for f in functions), "the forward's matmuls ran under the profile"


@pytest.mark.parametrize(
    "spec,kind,variants,batch,chunk,cached",
    [
        ("base-b1", "base", 0, 1, 0, 0),
        ("delta8-b64", "delta", 8, 64, 0, 0),
        ("lora64-b64", "lora", 64, 64, 0, 0),
        ("lora8-b128-c256", "lora", 8, 128, 256, 0),
        ("base-b0-c32-p992", "base", 0, 0, 32, 992),
        ("lora3-b4-c8-p0", "lora", 3, 4, 8, 0),
    ],
)
def test_case_specs(spec: str, kind: str, variants: int, batch: int, chunk: int, cached: int) -> None:
    case = profile_step.parse_case(spec)
    assert (case.kind, case.variants, case.batch, case.chunk, case.cached) == (kind, variants, batch, chunk, cached)
    assert len(case.rows(5)) == batch and (kind == "base" or set(case.rows(5)) <= set(range(5, 5 + variants)))


@pytest.mark.parametrize(
    "spec",
    ["lora-b4", "delta0-b4", "base-b0", "base", "zoo1-b2", "base-b2-c0", "lora2-b2-c", "base-b2-p16", "base-b0-c0-p8"],
)
def test_bad_case_specs_are_refused(spec: str) -> None:
    with pytest.raises(SystemExit, match="--cases"):
        profile_step.parse_case(spec)


@pytest.mark.parametrize(
    "name,kind",
    [
        ("void (anonymous namespace)::sbmm_kernel<__half, 4, true, 2, 64, true>", "sbmm"),
        ("_mbgmv_expand_kernel", "lora"),
        ("nvjet_sm90_hsh_168x64_64x7_2x1_v_bz_TNN", "gemm"),
        ("paged_decode_kernel", "attention"),
        ("_rmsnorm_kernel", "norm"),
        ("_dense_delta_kernel", "lm_head delta"),
        ("void at::native::vectorized_gather_kernel<16, long>", "gather / index"),
        ("something_new", "other"),
    ],
)
def test_kernel_kinds(name: str, kind: str) -> None:
    assert profile_step.kind_of(name) == kind
