"""``zoo add / ls / rm`` offline: dedup of identical blocks, logit-lens similarities, opt-in sharing of
equivalent blocks, garbage collection, and refusals naming the file and field."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from deltaserve.compress import DeltaLineageError, load_delta
from deltaserve.zoo import ZooError, add_variant, describe, read_manifest, remove_variant, sizes
from deltaserve.zoo.__main__ import main as zoo_main
from deltaserve.zoo.manifest import own_blocks

from .conftest import CHEAP, ZooFixture, perturb

CHANGED = ["layers.1.attn", "layers.1.mlp", "layers.2.attn", "layers.2.mlp"]


def test_identical_blocks_are_stored_once(zoo_fixture: ZooFixture) -> None:
    m = read_manifest(zoo_fixture.zoo)
    ft1, ft2 = m["variants"]["ft1"], m["variants"]["ft2"]
    assert [m["blocks"][b]["component"] for b in own_blocks(ft1)] == CHANGED
    assert [m["blocks"][b]["component"] for b in own_blocks(ft2)] == ["layers.0.attn", "layers.0.mlp", *CHANGED]
    assert own_blocks(ft2)[2:] == own_blocks(ft1)  # ft2's copy of ft1's layers is ft1's blocks
    assert len(m["blocks"]) == 6 and len(list((zoo_fixture.zoo / "blocks").iterdir())) == 6
    s = sizes(m)
    assert s.stored_bytes < s.own_bytes["ft1"] + s.own_bytes["ft2"]
    assert s.dedup_saved == s.own_bytes["ft1"]
    # the lazy chain: unchanged components merge into base runs
    assert ft1["chain"][0] == {"components": ["embed", "layers.0.mlp"], "block": "base"}
    assert ft1["chain"][-1] == {"components": ["head", "head"], "block": "base"}
    # the served delta directory reads the block files (hard links) and holds only own layers
    manifest, packed, dense = load_delta(zoo_fixture.zoo / ft1["delta_dir"])
    assert manifest["partial"] is True and {k.split(".")[2] for k in packed} == {"1", "2"}
    block_file = zoo_fixture.zoo / m["blocks"][own_blocks(ft1)[0]]["file"]
    assert block_file.stat().st_nlink == 3  # the block, ft1's link, ft2's link


def test_similarity_is_one_for_unchanged_blocks_and_low_for_heavy_changes(zoo_fixture: ZooFixture) -> None:
    sim = read_manifest(zoo_fixture.zoo)["variants"]["ft1"]["similarity"]
    assert all(sim[c] == 1.0 for c in ("embed", "layers.0.attn", "layers.0.mlp", "head"))
    assert all(sim[c] < 0.98 for c in CHANGED), sim


def test_equivalent_blocks_are_shared_only_with_the_opt_in(zoo_fixture: ZooFixture, tmp_path: Path) -> None:
    # tiny changes to layers 0 and 2: both equivalent at 0.98; layer 0 is never shared unless asked
    ft = perturb(zoo_fixture.base, tmp_path / "light", ["model.layers.0.mlp.", "model.layers.2.mlp."], 1e-3, 3)
    opts = replace(CHEAP, dense=True)
    add_variant(tmp_path / "z", zoo_fixture.base, "plain", ft, opts, progress=None)
    add_variant(tmp_path / "z", zoo_fixture.base, "shared", ft, replace(opts, share_equivalent=True), progress=None)
    m = read_manifest(tmp_path / "z")
    plain, shared = m["variants"]["plain"], m["variants"]["shared"]
    assert plain["similarity"]["layers.2.mlp"] >= 0.98 and plain["similarity"]["layers.0.mlp"] >= 0.98
    assert [m["blocks"][b]["component"] for b in own_blocks(plain)] == ["layers.0.mlp", "layers.2.mlp"]
    assert plain["shared_equivalent"] == [] and shared["shared_equivalent"] == ["layers.2.mlp"]
    assert own_blocks(shared) == own_blocks(plain)[:1]  # the dense layer-0 block, stored once
    assert len(m["blocks"]) == 2 and "delta_dir" not in plain
    with pytest.raises(ZooError, match="would be the base model"):
        add_variant(tmp_path / "z", zoo_fixture.base, "all", ft,
                    replace(opts, share_equivalent=True, share_from_layer=0), progress=None)  # fmt: skip


def test_rm_collects_unused_blocks(zoo_fixture: ZooFixture, tmp_path: Path) -> None:
    zoo = tmp_path / "zoo"
    shutil.copytree(zoo_fixture.zoo, zoo)
    before = read_manifest(zoo)
    gone = remove_variant(zoo, "ft2")
    assert sorted(gone) == sorted(own_blocks(before["variants"]["ft2"])[:2])
    m = read_manifest(zoo)
    assert set(m["blocks"]) == set(own_blocks(before["variants"]["ft1"])) and not (zoo / "variants" / "ft2").exists()
    assert len(list((zoo / "blocks").iterdir())) == 4
    assert zoo_main(["rm", "--zoo", str(zoo), "--name", "ft1"]) == 0
    assert read_manifest(zoo)["blocks"] == {} and list((zoo / "blocks").iterdir()) == []
    assert zoo_main(["rm", "--zoo", str(zoo), "--name", "ft1"]) == 2  # no such variant: an answer


def test_ls_prints_chains_sharing_and_savings(zoo_fixture: ZooFixture, capsys: pytest.CaptureFixture[str]) -> None:
    text = describe(zoo_fixture.zoo)
    assert "variant ft1" in text and "shared with ft2" in text and "base[embed..layers.0.mlp]" in text
    assert "identical blocks save" in text
    assert zoo_main(["ls", "--zoo", str(zoo_fixture.zoo)]) == 0
    assert capsys.readouterr().out.strip() == text


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda m: m.update(format_version=99), "'format_version'"),
        (lambda m: next(iter(m["blocks"].values())).update(bytes=1), "'blocks."),
        (lambda m: m["variants"]["ft1"]["chain"][1].update(block="nope"), "'variants.ft1.chain[1].block'"),
        (lambda m: m["variants"]["ft1"]["chain"].pop(0), "'variants.ft1.chain'"),
        (lambda m: m["base"].pop("components"), "'base.components'"),
    ],
)
def test_corrupt_manifest_is_refused_naming_file_and_field(
    zoo_fixture: ZooFixture, tmp_path: Path, edit, field
) -> None:
    zoo = tmp_path / "zoo"
    shutil.copytree(zoo_fixture.zoo, zoo)
    m = json.loads((zoo / "manifest.json").read_text())
    edit(m)
    (zoo / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ZooError, match="manifest.json") as e:
        read_manifest(zoo)
    assert field in str(e.value)
    before = (zoo / "manifest.json").read_text()
    assert zoo_main(["rm", "--zoo", str(zoo), "--name", "ft2"]) == 2
    assert (zoo / "manifest.json").read_text() == before and (zoo / "variants" / "ft2").exists()


def test_mismatched_lineage_is_refused_by_name(zoo_fixture: ZooFixture, tiny_llama: Path, tmp_path: Path) -> None:
    zoo = tmp_path / "zoo"
    shutil.copytree(zoo_fixture.zoo, zoo)
    before = (zoo / "manifest.json").read_text()
    other_base = perturb(zoo_fixture.base, tmp_path / "other", ["model.embed_tokens."], 0.1, 4)
    with pytest.raises(DeltaLineageError, match=r"variant x: .*field 'base.components.embed'"):
        add_variant(zoo, other_base, "x", zoo_fixture.ft1, CHEAP, progress=None)
    with pytest.raises(DeltaLineageError, match=r"variant y: .*num_hidden_layers"):
        add_variant(zoo, zoo_fixture.base, "y", tiny_llama, CHEAP, progress=None)
    with pytest.raises(ZooError, match="already in the zoo"):
        add_variant(zoo, zoo_fixture.base, "ft1", zoo_fixture.ft1, CHEAP, progress=None)
    assert (zoo / "manifest.json").read_text() == before
