"""``zoo add``: a fine-tune into the zoo as a chain of base runs and own blocks (BlockLLM §4.3).

    check the fine-tune against the base (config fields, tensor shapes) and the base against the
        zoo's lineage (every component's content hash)
    per component: identical to the base (content hash)          -> the base block
                   else similarity = logit lens (``lens.py``)    recorded for every component
                        equivalent (>= threshold), --share-equivalent, layer >= --share-from-layer
                                                                 -> the base block (changes the model)
                        else                                     -> an own block
    own blocks already in the zoo (same id: same tensors, same storage) are reused; the new ones are
        written: ΔCompress deltas against the base (``compress`` restricted to the variant's own
        tensors, so calibration runs through the variant's real chain) or, with --dense, the tensors
    chain = consecutive base components merged into one segment (lazy partitioning), then own blocks
    delta storage: ``variants/<name>/`` a partial delta directory (payload = hard links to its block
        files) that the worker serves with the compressed-delta machinery
    --substitute-min-similarity X (opt-in): the own blocks with similarity >= X (layer >=
        --share-from-layer) may run as the base's under load (``deltaserve --substitute-above``);
        ``substitutes/<name>/`` is the delta directory of the variant without them (none when no own
        block is left: the substitute is the base model)
    manifest written last (atomically): a failure leaves the zoo as it was, plus unreferenced files
        the next ``zoo rm`` collects

A block reused from another variant was compressed with that variant's calibration stream; the
variant's reference model is what its blocks hold (``materialize`` of its delta directory).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, TextIO

import torch
from safetensors.torch import save_file

from ..compress import delta_dir
from ..compress.calib import calibration_samples, load_calibration
from ..compress.compressor import CompressConfig, compress
from ..compress.delta_dir import (
    DeltaLineageError,
    as_json,
    compare_signatures,
    load_delta,
    model_signature,
    signature_hash,
)
from ..model.arch import ModelConfig
from .blocks import Checkpoint, component_hashes, component_of, components, is_sandwich, layer_of, tensor_names
from .lens import lens_similarities
from .manifest import (
    BASE_BLOCK,
    BLOCKS_DIR,
    MANIFEST,
    SUBSTITUTES_DIR,
    VARIANTS_DIR,
    ZooError,
    empty_manifest,
    own_ids,
    read_manifest,
    write_manifest,
)

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


@dataclass(frozen=True)
class AddOptions:
    """The settings of one ``zoo add`` (its flags)."""

    threshold: float = 0.98
    """Logit-lens similarity at or above which a block counts as equivalent to the base's."""
    share_equivalent: bool = False
    """Serve equivalent (not identical) components with the base block: changes the model, opt-in."""
    share_from_layer: int | None = None
    """First decoder layer whose equivalent components may be shared (None: max(1, layers // 4); the
    embedding counts as layer -1, the head as the last): early-layer sharing hurts accuracy (§4.2)."""
    dense: bool = False
    """Store own blocks as the fine-tuned tensors instead of ΔCompress deltas."""
    calib: str | None = None
    """Calibration JSONL (``compress.calib``) for the lens and the compressor; None: built-in texts."""
    bits: int = 4
    sparse: bool = True
    group_size: int = 64
    nsamples: int = 32
    """Most calibration sequences (lens and compressor)."""
    seqlen: int = 256
    """Longest calibration sequence."""
    substitute_min_similarity: float | None = None
    """Opt in to accuracy-aware substitution under load: own blocks at least this similar to the base's
    (layer >= ``share_from_layer``) may run as the base's when the server is loaded; None: never."""

    def validate(self) -> None:
        if not 0.0 < self.threshold <= 1.0:
            raise ZooError(f"--threshold must be in (0, 1], got {self.threshold}")
        x = self.substitute_min_similarity
        if x is not None and not 0.0 < x <= 1.0:
            raise ZooError(f"--substitute-min-similarity must be in (0, 1], got {x}")
        if self.share_from_layer is not None and self.share_from_layer < 0:
            raise ZooError(f"--share-from-layer must be >= 0, got {self.share_from_layer}")

    def storage_tag(self) -> str:
        """How own blocks are stored, as it appears in block ids."""
        if self.dense:
            return "dense"
        return f"q{self.bits}{'s' if self.sparse else 'd'}g{self.group_size}"


def add_variant(
    zoo: str | Path,
    base_dir: str | Path,
    name: str,
    finetuned_dir: str | Path,
    options: AddOptions = AddOptions(),
    progress: TextIO | None = sys.stderr,
) -> dict[str, Any]:
    """Adds ``finetuned_dir`` to the zoo as ``name`` (module docstring); returns its manifest entry.
    ZooError / DeltaLineageError (ValueErrors naming the variant, file and field) before any change."""
    options.validate()
    zoo, base_dir, finetuned_dir = Path(zoo), Path(base_dir), Path(finetuned_dir)
    log = (lambda msg: print(msg, file=progress, flush=True)) if progress is not None else (lambda msg: None)
    if not _NAME_RE.match(name):
        raise ZooError(f"--name {name!r}: use letters, digits, '.', '_' or '-' (at most 64, not starting with a sign)")

    base_cfg = ModelConfig.from_model_dir(base_dir)
    ft_cfg = ModelConfig.from_model_dir(finetuned_dir)
    base_sig, ft_sig = as_json(model_signature(base_cfg)), as_json(model_signature(ft_cfg))
    try:
        compare_signatures(base_sig, ft_sig, f"base {base_dir}", f"fine-tuned model {finetuned_dir}")
    except DeltaLineageError as e:
        raise DeltaLineageError(f"variant {name}: {e}") from e
    names = tensor_names(base_cfg)
    base_ck, ft_ck = Checkpoint(base_dir), Checkpoint(finetuned_dir)
    for what, ck in (("base", base_ck), ("fine-tuned model", ft_ck)):
        for comp, ns in names.items():
            for n in ns:
                if n not in ck.located:
                    raise DeltaLineageError(f"variant {name}: {what} {ck.model_dir} lacks tensor '{n}' ({comp})")
                if ck.located[n][1] != base_ck.located[n][1]:
                    raise DeltaLineageError(
                        f"variant {name}: {ck.located[n][0]}: tensor '{n}' has shape {list(ck.located[n][1])}, "
                        f"the base's is {list(base_ck.located[n][1])}"
                    )
    if base_cfg.tie_word_embeddings and "lm_head.weight" in ft_ck.located:
        if not torch.equal(ft_ck.get("lm_head.weight"), ft_ck.get("model.embed_tokens.weight")):
            raise DeltaLineageError(f"variant {name}: {finetuned_dir} unties lm_head from a base that ties it")

    base_hashes = component_hashes(base_ck, names)
    manifest_path = zoo / MANIFEST
    if manifest_path.exists():
        manifest = read_manifest(zoo)
        _check_base(manifest, manifest_path, base_dir, base_sig, base_hashes, name)
    else:
        manifest = empty_manifest(
            {"name": base_dir.resolve().name, "config": base_sig, "config_sha256": signature_hash(base_sig),
             "components": base_hashes}
        )  # fmt: skip
    if name in manifest["variants"]:
        raise ZooError(f"{manifest_path}: variant '{name}' is already in the zoo (`zoo rm` it first)")

    order = components(base_cfg.num_layers)
    ft_hashes = component_hashes(ft_ck, names)
    differing = [c for c in order if ft_hashes[c] != base_hashes[c]]
    if not differing:
        raise ZooError(f"variant {name}: {finetuned_dir} is identical to the base {base_dir}: serve the base")
    options = _with_defaults(options, base_cfg)
    log(f"zoo add {name}: {len(differing)} of {len(order)} components differ from the base; logit lens ...")
    items = load_calibration(options.calib)
    samples = calibration_samples(
        items, base_dir, options.nsamples, options.seqlen, base_cfg.vocab_size, base_cfg.bos_token_id
    )
    similarity = {c: 1.0 for c in order}
    similarity.update(lens_similarities(base_dir, finetuned_dir, samples, set(differing)))
    assert options.share_from_layer is not None  # _with_defaults
    shared = [
        c for c in differing
        if options.share_equivalent and similarity[c] >= options.threshold
        and layer_of(c) >= options.share_from_layer
    ]  # fmt: skip
    own = [c for c in differing if c not in shared]
    if not own:
        raise ZooError(
            f"variant {name}: every differing block is equivalent at --threshold {options.threshold} and shared: "
            "the variant would be the base model"
        )
    tag = options.storage_tag()
    block_id = {c: f"{c}.{ft_hashes[c][:16]}.{tag}" for c in own}
    new = [c for c in own if block_id[c] not in manifest["blocks"]]
    log(f"zoo add {name}: own blocks {own} ({len(own) - len(new)} already in the zoo), shared equivalent {shared}")
    (zoo / BLOCKS_DIR).mkdir(parents=True, exist_ok=True)
    if new:
        written = (
            _dense_blocks(ft_ck, names, new)
            if options.dense
            else _delta_blocks(zoo, base_dir, finetuned_dir, name, names, own, new, options, progress)
        )
        for c, (tensors, entries) in written.items():
            bid = block_id[c]
            rel = f"{BLOCKS_DIR}/{bid}.safetensors"
            tmp = zoo / (rel + ".tmp")
            save_file(tensors, str(tmp))
            os.replace(tmp, zoo / rel)
            block: dict[str, Any] = {
                "component": c, "storage": "dense" if options.dense else "delta", "file": rel,
                "bytes": (zoo / rel).stat().st_size, "content_sha256": ft_hashes[c], "tensors": entries,
            }  # fmt: skip
            if not options.dense:
                block["compression"] = {
                    "bits": options.bits, "sparsity": "2:4" if options.sparse else "none",
                    "group_size": options.group_size,
                }  # fmt: skip
            manifest["blocks"][bid] = block

    chain: list[dict[str, Any]] = []
    for c in order:
        if c in own:
            chain.append({"component": c, "block": block_id[c]})
        elif chain and chain[-1]["block"] == BASE_BLOCK:
            chain[-1]["components"][1] = c
        else:
            chain.append({"components": [c, c], "block": BASE_BLOCK})
    fp16_bytes = sum(2 * _numel(base_ck.located[n][1]) for ns in names.values() for n in ns)
    entry: dict[str, Any] = {
        "finetuned": {"name": finetuned_dir.resolve().name, "config_sha256": signature_hash(ft_sig)},
        "storage": "dense" if options.dense else "delta",
        "options": asdict(options),
        "chain": chain,
        "similarity": {c: round(similarity[c], 6) for c in order},
        "shared_equivalent": shared,
        "fp16_bytes": fp16_bytes,
    }
    manifest["variants"][name] = entry
    if not options.dense:
        entry["delta_dir"] = f"{VARIANTS_DIR}/{name}"
        write_delta_dir(zoo, entry["delta_dir"], name, manifest, base_ck, names, base_sig, entry, own_ids(chain))
    if options.substitute_min_similarity is not None:
        x = options.substitute_min_similarity
        subst = [c for c in own if similarity[c] >= x and layer_of(c) >= options.share_from_layer]
        entry["substitution"] = {"min_similarity": x, "components": subst, "delta_dir": None}
        keep = [block_id[c] for c in own if c not in subst]
        if subst and keep and not options.dense:
            entry["substitution"]["delta_dir"] = f"{SUBSTITUTES_DIR}/{name}"
            write_delta_dir(zoo, f"{SUBSTITUTES_DIR}/{name}", name, manifest, base_ck, names, base_sig, entry, keep)
        log(f"zoo add {name}: substitutable under load (similarity >= {x}): {subst or 'none'}")
    write_manifest(zoo, manifest)
    return entry


def _with_defaults(options: AddOptions, cfg: ModelConfig) -> AddOptions:
    if options.share_from_layer is not None:
        return options
    return replace(options, share_from_layer=max(1, cfg.num_layers // 4))


def _check_base(
    manifest: dict[str, Any], path: Path, base_dir: Path, sig: dict[str, Any], hashes: dict[str, str], name: str
) -> None:
    """Refuses a base that is not the zoo's: its config, then each component's content."""
    try:
        compare_signatures(
            manifest["base"]["config"], sig, f"the zoo's base ({path}, field 'base.config')", f"base {base_dir}"
        )
    except DeltaLineageError as e:
        raise DeltaLineageError(f"variant {name}: {e}") from e
    recorded = manifest["base"]["components"]
    for c, h in hashes.items():
        if recorded.get(c) != h:
            raise DeltaLineageError(
                f"variant {name}: base {base_dir} is not the zoo's base {manifest['base']['name']!r}: its {c} "
                f"differs ({path}, field 'base.components.{c}')"
            )


def _dense_blocks(
    ft_ck: Checkpoint, names: dict[str, list[str]], new: list[str]
) -> dict[str, tuple[dict[str, torch.Tensor], dict[str, Any]]]:
    """The fine-tuned tensors of each new component, as stored."""
    out = {}
    for c in new:
        tensors = {n: t.contiguous() for n, t in ft_ck.tensors(names[c])}
        entries = {n: {"kind": "dense", "shape": list(t.shape), "bytes": t.nbytes} for n, t in tensors.items()}
        out[c] = (tensors, entries)
    return out


def _delta_blocks(
    zoo: Path,
    base_dir: Path,
    ft_dir: Path,
    name: str,
    names: dict[str, list[str]],
    own: list[str],
    new: list[str],
    options: AddOptions,
    progress: TextIO | None,
) -> dict[str, tuple[dict[str, torch.Tensor], dict[str, Any]]]:
    """ΔCompress deltas of the new components: the compressor runs on the variant's chain (its own
    components from the fine-tune, the base elsewhere) and the new components' tensors are kept."""
    scratch = zoo / f".add-{name}"
    shutil.rmtree(scratch, ignore_errors=True)
    only = frozenset(n for c in own for n in names[c])
    config = CompressConfig(
        bits=options.bits, sparse=options.sparse, group_size=options.group_size, calib=options.calib,
        nsamples=options.nsamples, seqlen=options.seqlen, only=only,
    )  # fmt: skip
    try:
        compress(base_dir, ft_dir, scratch, config, progress)
        delta_manifest, packed, dense = load_delta(scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    out: dict[str, tuple[dict[str, torch.Tensor], dict[str, Any]]] = {c: ({}, {}) for c in new}
    sandwich = is_sandwich([n for ns in names.values() for n in ns])
    for module, p in packed.items():
        c = component_of(f"{module}.weight", sandwich)
        if c in out:
            for suffix, t in p.tensors().items():
                out[c][0][f"{module}.{suffix}"] = t.contiguous().clone()
            out[c][1][module] = delta_manifest["tensors"][module]
    for tname, t in dense.items():
        c = component_of(tname, sandwich)
        if c in out:
            out[c][0][tname] = t.contiguous().clone()
            out[c][1][tname] = delta_manifest["tensors"][tname]
    return out


def write_delta_dir(
    zoo: Path,
    rel: str,
    name: str,
    manifest: dict[str, Any],
    base_ck: Checkpoint,
    names: dict[str, list[str]],
    base_sig: dict[str, Any],
    entry: dict[str, Any],
    blocks: list[str],
) -> None:
    """``<zoo>/<rel>`` (``variants/<name>``, ``substitutes/<name>``): a partial delta directory over the
    block files ``blocks`` (hard links; every other component runs the base's)."""
    out = zoo / rel
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    files, tensors, total = [], {}, 0
    compression: dict[str, Any] = {}
    for bid in blocks:
        block = manifest["blocks"][bid]
        src = zoo / block["file"]
        dst = out / src.name
        try:
            os.link(src, dst)
        except OSError:
            shutil.copyfile(src, dst)  # no hard links on this file system: a copy
        files.append(dst.name)
        tensors.update(block["tensors"])
        total += block["bytes"]
        compression = block["compression"]
    delta_manifest = {
        "format": delta_dir.FORMAT,
        "format_version": delta_dir.FORMAT_VERSION,
        "mode": "delta",
        "partial": True,
        "zoo": {"manifest": f"../../{MANIFEST}", "variant": name, "substitute": rel.startswith(SUBSTITUTES_DIR)},
        "base": {"name": manifest["base"]["name"], "config": base_sig, "config_sha256": signature_hash(base_sig)},
        "finetuned": entry["finetuned"],
        "base_shapes": {n: list(base_ck.located[n][1]) for ns in names.values() for n in ns},
        "compression": {**compression, "method": "obs"},
        "payload": {"files": files, "codec": "none", "bytes": total, "raw_bytes": total},
        "tensors": tensors,
        "dropped": [],
        "sizes": {
            "payload_bytes": total,
            "finetuned_fp16_bytes": entry["fp16_bytes"],
            "compression_ratio": entry["fp16_bytes"] / max(total, 1),
        },
    }
    (out / delta_dir.MANIFEST).write_text(json.dumps(delta_manifest, indent=1) + "\n")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
