"""``zoo ls`` and ``zoo rm``: what the zoo holds, what is shared and saved; removing a variant and
collecting the blocks no chain uses."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .manifest import (
    BASE_BLOCK,
    BLOCKS_DIR,
    SUBSTITUTES_DIR,
    VARIANTS_DIR,
    ZooError,
    own_blocks,
    read_manifest,
    used_blocks,
    write_manifest,
)


@dataclass(frozen=True)
class ZooSizes:
    """The bytes ``zoo ls`` reports."""

    stored_bytes: int
    """Every block file, once."""
    own_bytes: dict[str, int]
    """Variant -> the bytes of its own blocks (as if it were stored alone)."""
    fp16_bytes: dict[str, int]
    """Variant -> its whole model in fp16 (per-model provisioning)."""

    @property
    def dedup_saved(self) -> int:
        """Bytes identical blocks save: the variants' own bytes minus what is stored."""
        return sum(self.own_bytes.values()) - self.stored_bytes


def sizes(manifest: dict[str, Any]) -> ZooSizes:
    blocks = manifest["blocks"]
    return ZooSizes(
        stored_bytes=sum(b["bytes"] for b in blocks.values()),
        own_bytes={n: sum(blocks[b]["bytes"] for b in own_blocks(v)) for n, v in manifest["variants"].items()},
        fp16_bytes={n: int(v.get("fp16_bytes", 0)) for n, v in manifest["variants"].items()},
    )


def describe(zoo: str | Path) -> str:
    """``zoo ls``'s text: the base, each variant's chain (own blocks, who else uses them, similarities
    below 1), the blocks shared by equivalence, and the bytes saved."""
    m = read_manifest(zoo)
    users: dict[str, list[str]] = {}
    for name, v in m["variants"].items():
        for b in own_blocks(v):
            users.setdefault(b, []).append(name)
    s = sizes(m)
    lines = [
        f"zoo {zoo}: base {m['base']['name']}, {len(m['variants'])} variants, {len(m['blocks'])} blocks "
        f"({s.stored_bytes:,} bytes)"
    ]
    for name, v in m["variants"].items():
        served = f"served as a delta ({v['delta_dir']})" if v.get("delta_dir") else "not served (dense blocks)"
        lines.append(f"variant {name} ({v['storage']}, {served}): own {s.own_bytes[name]:,} bytes, fp16 model "
                     f"{s.fp16_bytes[name]:,} bytes")  # fmt: skip
        parts = []
        for seg in v["chain"]:
            if seg["block"] == BASE_BLOCK:
                first, last = seg["components"]
                parts.append(f"base[{first}]" if first == last else f"base[{first}..{last}]")
            else:
                others = [u for u in users[seg["block"]] if u != name]
                parts.append(seg["block"] + (f" (shared with {', '.join(others)})" if others else ""))
        lines.append("  chain: " + " -> ".join(parts))
        sims = {c: x for c, x in v["similarity"].items() if x < 1.0}
        if sims:
            lines.append("  similarity: " + ", ".join(f"{c} {x:.4f}" for c, x in sims.items()))
        if v.get("shared_equivalent"):
            lines.append("  shared by equivalence (base block): " + ", ".join(v["shared_equivalent"]))
        sub = v.get("substitution")
        if sub is not None:
            runs = sub["delta_dir"] or "the base model"
            what = ", ".join(sub["components"]) or "none (nothing to substitute)"
            lines.append(f"  under load (similarity >= {sub['min_similarity']}) the base's: {what}; runs {runs}")
    fp16 = sum(s.fp16_bytes.values())
    lines.append(
        f"bytes: variants' own blocks {sum(s.own_bytes.values()):,}, stored once {s.stored_bytes:,} "
        f"(identical blocks save {s.dedup_saved:,}); whole fp16 models {fp16:,} (saved {fp16 - s.stored_bytes:,})"
    )
    return "\n".join(lines)


def remove_variant(zoo: str | Path, name: str) -> list[str]:
    """Removes ``name`` and garbage-collects blocks no chain uses (files in ``blocks/`` the manifest
    does not list too: leftovers of an interrupted ``add``); returns the block ids removed."""
    zoo = Path(zoo)
    m = read_manifest(zoo)
    if name not in m["variants"]:
        known = ", ".join(m["variants"]) or "none"
        raise ZooError(f"{zoo}: no variant '{name}' (variants: {known})")
    del m["variants"][name]
    keep = used_blocks(m)
    gone = sorted(set(m["blocks"]) - keep)
    files = {m["blocks"][b]["file"] for b in gone}
    for b in gone:
        del m["blocks"][b]
    write_manifest(zoo, m)  # first: a crash below leaves only unreferenced files
    shutil.rmtree(zoo / VARIANTS_DIR / name, ignore_errors=True)
    shutil.rmtree(zoo / SUBSTITUTES_DIR / name, ignore_errors=True)
    listed = {b["file"] for b in m["blocks"].values()}
    for f in sorted(files | {f"{BLOCKS_DIR}/{p.name}" for p in (zoo / BLOCKS_DIR).glob("*")}):
        if f not in listed:
            (zoo / f).unlink(missing_ok=True)
    return gone
