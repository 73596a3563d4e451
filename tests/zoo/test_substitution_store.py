"""Substitution under load, offline: what ``zoo add --substitute-min-similarity`` records and writes,
what ``zoo ls`` says, ``zoo rm`` collecting the substitute, and a corrupt entry refused by field."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from deltaserve.compress import load_delta
from deltaserve.zoo import ZooError, describe, read_manifest, remove_variant

from .conftest import SubZooFixture


def test_only_the_opted_in_variant_records_a_substitute(sub_zoo: SubZooFixture) -> None:
    m = read_manifest(sub_zoo.zoo)
    ft1, ft3 = m["variants"]["ft1"], m["variants"]["ft3"]
    assert "substitution" not in ft1
    sub = ft3["substitution"]
    assert ft3["similarity"]["layers.1.attn"] >= 0.98 > ft3["similarity"]["layers.2.attn"]
    assert sub == {"min_similarity": 0.98, "components": ["layers.1.attn", "layers.1.mlp"],
                   "delta_dir": "substitutes/ft3"}  # fmt: skip
    manifest, packed, _ = load_delta(sub_zoo.zoo / sub["delta_dir"])  # layer 2 only: layer 1 runs the base's
    assert manifest["partial"] is True and {k.split(".")[2] for k in packed} == {"2"}
    _, own, _ = load_delta(sub_zoo.zoo / ft3["delta_dir"])
    assert {k.split(".")[2] for k in own} == {"1", "2"}
    assert "under load (similarity >= 0.98) the base's: layers.1.attn, layers.1.mlp" in describe(sub_zoo.zoo)


def test_rm_removes_the_substitute(sub_zoo: SubZooFixture, tmp_path: Path) -> None:
    zoo = tmp_path / "zoo"
    shutil.copytree(sub_zoo.zoo, zoo)
    remove_variant(zoo, "ft3")
    assert not (zoo / "substitutes" / "ft3").exists() and set(read_manifest(zoo)["variants"]) == {"ft1", "ft2"}


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda s: s.update(min_similarity=1.5), "'variants.ft3.substitution.min_similarity'"),
        (lambda s: s.update(components=["head"]), "'variants.ft3.substitution.components'"),
        (lambda s: s.update(delta_dir="substitutes/nope"), "'variants.ft3.substitution.delta_dir'"),
    ],
)
def test_a_corrupt_substitution_is_refused_naming_file_and_field(
    sub_zoo: SubZooFixture, tmp_path: Path, edit, field
) -> None:
    zoo = tmp_path / "zoo"
    shutil.copytree(sub_zoo.zoo, zoo)
    m = json.loads((zoo / "manifest.json").read_text())
    edit(m["variants"]["ft3"]["substitution"])
    (zoo / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ZooError, match="manifest.json") as e:
        read_manifest(zoo)
    assert field in str(e.value)
