"""The zoo directory and its versioned manifest: reading, validating, writing atomically.

Layout::

    <zoo>/manifest.json
        format "deltaserve-zoo", format_version 1
        base        {"name", "config" (model_signature), "config_sha256",
                     "components": {component: content sha256}}   the lineage every variant must match
        blocks      block id -> {"component", "storage": "delta" | "dense", "file", "bytes",
                                 "content_sha256" (the fine-tuned tensors it stands for),
                                 "compression": {bits, sparsity, group_size} (delta only),
                                 "tensors": {name: entry as in a delta manifest}}
        variants    name -> {"finetuned": {"name", "config_sha256"}, "storage", "options",
                             "chain": [{"components": [first, last], "block": "base"} | {"component", "block": id}],
                             "similarity": {component: float} (1.0 where identical to the base),
                             "shared_equivalent": [components served by the base block although they differ],
                             "fp16_bytes", "delta_dir": "variants/<name>" (delta storage only),
                             "substitution" (opt-in, ``zoo add --substitute-min-similarity``):
                                 {"min_similarity", "components": [own components substitutable],
                                  "delta_dir": "substitutes/<name>" | null (the base model)}}
    <zoo>/blocks/<id>.safetensors       one own block: a ΔCompress delta of its tensors against the base
                                        (delta-directory tensor names) or the fine-tuned tensors (dense)
    <zoo>/variants/<name>/              delta storage: a delta directory the worker serves (``partial``),
                                        its payload hard links to the variant's block files
    <zoo>/substitutes/<name>/           the same without the substitutable blocks: what the variant
                                        runs under load (``deltaserve --substitute-above``)

Block ids are ``<component>.<content sha256, 16 hex>.<storage tag>``: the same tensors stored the same
way are one block, whichever variant brings them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

FORMAT = "deltaserve-zoo"
"""``manifest.json`` ``format`` value."""
FORMAT_VERSION = 1
"""Bumped on any incompatible change of the layout."""
MANIFEST = "manifest.json"
BLOCKS_DIR = "blocks"
VARIANTS_DIR = "variants"
SUBSTITUTES_DIR = "substitutes"
BASE_BLOCK = "base"
"""The ``block`` of a chain segment that runs the base model's components."""


class ZooError(ValueError):
    """A zoo, manifest entry or request that cannot be used; the message names the file and field."""


def empty_manifest(base: dict[str, Any]) -> dict[str, Any]:
    return {"format": FORMAT, "format_version": FORMAT_VERSION, "base": base, "blocks": {}, "variants": {}}


def _need(cond: bool, path: Path, field: str, what: str) -> None:
    if not cond:
        raise ZooError(f"{path}: field '{field}' {what}")


def read_manifest(zoo: str | Path) -> dict[str, Any]:
    """The zoo's manifest, validated: format and version, every block's file present with its size,
    every chain's blocks known and its components in order; ZooError names the file and field."""
    zoo = Path(zoo)
    path = zoo / MANIFEST
    if not path.is_file():
        raise ZooError(f"{zoo}: no {MANIFEST} (not a zoo; `zoo add` creates one)")
    try:
        m = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ZooError(f"{path}: not valid JSON: {e}") from e
    _need(isinstance(m, dict) and m.get("format") == FORMAT, path, "format", f"must be {FORMAT!r}")
    _need(
        m.get("format_version") == FORMAT_VERSION, path, "format_version",
        f"is {m.get('format_version')!r}; this reader knows {FORMAT_VERSION}",
    )  # fmt: skip
    for key in ("base", "blocks", "variants"):
        _need(isinstance(m.get(key), dict), path, key, "is missing or not an object")
    base = m["base"]
    for key in ("name", "config", "components"):
        _need(key in base, path, f"base.{key}", "is missing")
    comps = base["components"]
    _need(isinstance(comps, dict) and bool(comps), path, "base.components", "must be a non-empty object")
    for bid, b in m["blocks"].items():
        where = f"blocks.{bid}"
        _need(isinstance(b, dict), path, where, "is not an object")
        for key in ("component", "storage", "file", "bytes", "content_sha256", "tensors"):
            _need(key in b, path, f"{where}.{key}", "is missing")
        _need(b["component"] in comps, path, f"{where}.component", f"{b['component']!r} is not a base component")
        _need(b["storage"] in ("delta", "dense"), path, f"{where}.storage", "must be 'delta' or 'dense'")
        f = zoo / str(b["file"])
        _need(f.is_file(), path, f"{where}.file", f"names {f}, which does not exist")
        _need(
            f.stat().st_size == b["bytes"], path, f"{where}.bytes",
            f"is {b['bytes']}, but {f} has {f.stat().st_size} bytes",
        )  # fmt: skip
    order = list(comps)
    for name, v in m["variants"].items():
        where = f"variants.{name}"
        _need(isinstance(v, dict) and isinstance(v.get("chain"), list), path, f"{where}.chain", "is missing")
        covered: list[str] = []
        for i, seg in enumerate(v["chain"]):
            at = f"{where}.chain[{i}]"
            _need(isinstance(seg, dict) and "block" in seg, path, f"{at}.block", "is missing")
            if seg["block"] == BASE_BLOCK:
                first, last = seg.get("components", [None, None])
                _need(first in comps and last in comps, path, f"{at}.components", "must name two base components")
                covered += order[order.index(first) : order.index(last) + 1]
            else:
                _need(seg["block"] in m["blocks"], path, f"{at}.block", f"{seg['block']!r} is not in 'blocks'")
                covered.append(m["blocks"][seg["block"]]["component"])
        _need(covered == order, path, f"{where}.chain", "does not cover every component once, in order")
        if "substitution" in v:
            _check_substitution(zoo, path, f"{where}.substitution", v, m["blocks"])
    return m


def _check_substitution(zoo: Path, path: Path, where: str, v: dict[str, Any], blocks: dict[str, Any]) -> None:
    s = v["substitution"]
    _need(isinstance(s, dict), path, where, "is not an object")
    x = s.get("min_similarity")
    ok = isinstance(x, (int, float)) and not isinstance(x, bool) and 0.0 < x <= 1.0
    _need(ok, path, f"{where}.min_similarity", f"is {x!r}; must be a number in (0, 1]")
    own = {blocks[b]["component"] for b in own_blocks(v)}
    comps = s.get("components")
    _need(isinstance(comps, list) and set(comps) <= own, path, f"{where}.components", "must list own components")
    d = s.get("delta_dir")
    _need(d is None or isinstance(d, str), path, f"{where}.delta_dir", "must be a string or null")
    if isinstance(d, str):
        _need((zoo / d / MANIFEST).is_file(), path, f"{where}.delta_dir", f"names {zoo / d}, which has no {MANIFEST}")


def write_manifest(zoo: Path, manifest: dict[str, Any]) -> None:
    """Writes the manifest atomically (a temporary file renamed over it)."""
    tmp = zoo / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp, zoo / MANIFEST)


def used_blocks(manifest: dict[str, Any]) -> set[str]:
    """Block ids some variant's chain uses."""
    return {seg["block"] for v in manifest["variants"].values() for seg in v["chain"] if seg["block"] != BASE_BLOCK}


def own_blocks(variant: dict[str, Any]) -> list[str]:
    """A variant's own block ids, in chain order."""
    return own_ids(variant["chain"])


def own_ids(chain: list[dict[str, Any]]) -> list[str]:
    """The own block ids of a chain, in order."""
    return [seg["block"] for seg in chain if seg["block"] != BASE_BLOCK]
