"""The delta directory on disk: manifest, safetensors payload, reader, lineage checks, reference materialiser.

Layout (written by ``deltaserve compress``, read by serving and tests)::

    <delta_dir>/manifest.json
        format "deltaserve-delta", format_version 1
        mode                "delta" (tensors are W_ft − W_base) | "full" (--full-weights: tensors are
                            W_ft itself, the SparseGPT baseline; the base is not added back)
        base / finetuned    lineage: {"name": dir name, "config": structural fields (model_signature),
                            "config_sha256": hash of that dict}
        base_shapes         every base checkpoint tensor the decoder reads -> shape
        compression         bits, sparsity "2:4" | "none", group_size, method, block_size, percdamp,
                            calibration {source, samples, tokens, seqlen}
        payload             {"file", "codec": "none" | "zstd" | "lzma", "bytes" (on disk), "raw_bytes"}, or
                            {"files": [...], "codec": "none", ...}: several safetensors files inside the
                            directory read as one payload (a block zoo variant: one file per own block)
        partial             true: block linears without a packed delta are the base's (a zoo variant)
        tensors             name -> {"kind": "packed" | "dense", "shape", "bytes", ...}
                            packed: HF module name (``model.layers.0.self_attn.q_proj``), shape [out, in],
                                    "rel_error" = ‖(W − W̃)X‖² / ‖WX‖² on the calibration inputs
                            dense:  HF tensor name (``model.embed_tokens.weight``), float16
        dropped             dense tensors left out because their delta is exactly zero (mode "delta")
        sizes               payload_bytes, finetuned_fp16_bytes, compression_ratio (fp16 / payload)
    <delta_dir>/delta.safetensors          (codec "none"; ``delta.safetensors.zst`` / ``.xz`` otherwise)
        <module>.qvalues / .qindices / .scales / .zeros   per packed linear (``pack`` format)
        <name>                                            per dense tensor, float16

``load_delta`` reads and validates a directory (every manifest entry present with its shape,
every ``PackedLinear`` well formed) and decompresses a lossless payload transparently. The payload
is read once into one host buffer (``alloc``: the worker's pinned arena, for fast copies to a GPU) and every
tensor is a view of it (``_read_payload``: the safetensors layout parsed in place, no further copy).
``check_lineage`` refuses a delta whose base config or tensor shapes differ from a base directory,
naming the field or tensor. ``materialize`` writes ``W_base + dequant(Δ̃)`` (or ``dequant(W̃)`` for
mode "full") as a plain HF directory: the dense reference of the greedy-equality tests and of the
quality evaluation. Errors are ``DeltaFormatError`` / ``DeltaLineageError`` (``ValueError``\\s).
"""

from __future__ import annotations

import hashlib
import json
import lzma
import math
import shutil
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save as st_save

from ..formats.packed_delta import PackedLinear
from ..model.arch import ModelConfig
from ..model.loader import checkpoint_files

FORMAT = "deltaserve-delta"
"""``manifest.json`` ``format`` value."""
FORMAT_VERSION = 1
"""Bumped on any incompatible change of the directory layout."""
MANIFEST = "manifest.json"
"""Manifest file name inside a delta directory."""
PAYLOAD_FILES = {"none": "delta.safetensors", "zstd": "delta.safetensors.zst", "lzma": "delta.safetensors.xz"}
"""Payload file name per lossless codec."""
PACKED_SUFFIXES = ("qvalues", "qindices", "scales", "zeros")
"""Tensor-name suffixes of one packed linear in the payload."""
MODES = ("delta", "full")
"""``manifest["mode"]`` values (module docstring)."""
_HF_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
)  # fmt: skip
"""Files ``materialize`` copies from the base directory."""

# ModelConfig field -> config.json key, for the fields that must agree between base and variant.
_SIGNATURE_KEYS = {
    "architecture": "architectures",
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "rms_norm_eps": "rms_norm_eps",
    "rope_theta": "rope_theta",
    "rope_scaling": "rope_scaling",
    "tie_word_embeddings": "tie_word_embeddings",
    "qkv_bias": "attention_bias",
    "o_bias": "attention_bias",
    "mlp_bias": "mlp_bias",
    "sliding_window": "sliding_window",
}


class DeltaFormatError(ValueError):
    """A delta directory that is missing, malformed, or inconsistent with its own manifest."""


class DeltaLineageError(ValueError):
    """A delta (or fine-tune) that does not fit a base: different architecture, config or shapes."""


def model_signature(cfg: ModelConfig) -> dict[str, Any]:
    """The config fields a delta depends on (shapes and numerics; not eos ids, dtype or max length)."""
    names = {f.name for f in fields(cfg)}
    return {k: getattr(cfg, k) for k in _SIGNATURE_KEYS if k in names}


def signature_hash(signature: dict[str, Any]) -> str:
    """sha256 of the canonical JSON of a ``model_signature``."""
    return hashlib.sha256(json.dumps(signature, sort_keys=True).encode()).hexdigest()


def compare_signatures(want: dict[str, Any], got: dict[str, Any], want_what: str, got_what: str) -> None:
    """Raise ``DeltaLineageError`` naming the first differing field (as its config.json key)."""
    for key in _SIGNATURE_KEYS:
        if want.get(key) != got.get(key):
            raise DeltaLineageError(
                f"{got_what} does not match {want_what}: config.json field '{_SIGNATURE_KEYS[key]}' "
                f"({key}) is {got.get(key)!r}, expected {want.get(key)!r}"
            )


def checkpoint_shapes(model_dir: Path) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """Every tensor of an HF directory's safetensors -> (file, shape), from the headers only."""
    out: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for f in checkpoint_files(Path(model_dir)):
        with safe_open(f, framework="pt") as sf:
            for key in sf.keys():
                out[key] = (f, tuple(sf.get_slice(key).get_shape()))
    return out


def check_lineage(manifest: dict[str, Any], base_dir: str | Path, delta_dir: str | Path = "delta") -> None:
    """Refuse (``DeltaLineageError``) a delta whose base differs from ``base_dir``.

    Checks the structural config fields, then every base tensor shape recorded in the manifest and
    every delta tensor's shape against the base checkpoint; messages name the field or tensor.
    """
    base_dir = Path(base_dir)
    base_cfg = ModelConfig.from_model_dir(base_dir)
    recorded = manifest["base"]["config"]
    have = as_json(model_signature(base_cfg))
    compare_signatures(recorded, have, f"the base of delta {delta_dir}", f"base {base_dir}")
    shapes = {k: v[1] for k, v in checkpoint_shapes(base_dir).items()}
    for name, shape in manifest.get("base_shapes", {}).items():
        have = shapes.get(name)
        if have is None:
            if name == "lm_head.weight" and base_cfg.tie_word_embeddings:
                continue
            raise DeltaLineageError(f"delta {delta_dir} expects base tensor '{name}', which {base_dir} lacks")
        if list(have) != list(shape):
            raise DeltaLineageError(
                f"delta {delta_dir}: base tensor '{name}' has shape {list(have)} in {base_dir}, "
                f"the delta was made for {list(shape)}"
            )
    for name, entry in manifest["tensors"].items():
        key = f"{name}.weight" if entry["kind"] == "packed" else name
        have = shapes.get(key)
        if have is None and key == "lm_head.weight" and base_cfg.tie_word_embeddings:
            have = shapes.get("model.embed_tokens.weight")
        if have is None or list(have) != list(entry["shape"]):
            raise DeltaLineageError(
                f"delta {delta_dir}: tensor '{name}' has shape {entry['shape']}, base {base_dir} has "
                f"{'no such tensor' if have is None else list(have)}"
            )


def as_json(obj: Any) -> Any:
    """Round-trip through JSON so tuples/ints compare like a manifest read back from disk."""
    return json.loads(json.dumps(obj))


def encode_payload(raw: bytes, codec: str) -> bytes:
    """Losslessly compress the safetensors bytes with ``codec`` ("none", "zstd", "lzma")."""
    if codec == "none":
        return raw
    if codec == "zstd":
        import zstandard

        return zstandard.ZstdCompressor(level=9).compress(raw)
    if codec == "lzma":
        return lzma.compress(raw, preset=0)  # higher presets: ~same ratio on packed codes, 3-5x slower
    raise ValueError(f"unknown lossless codec {codec!r}: want one of {sorted(PAYLOAD_FILES)}")


def decode_payload(data: bytes, codec: str, where: str) -> bytes:
    """Inverse of ``encode_payload``; ``where`` names the file in errors."""
    try:
        if codec == "none":
            return data
        if codec == "zstd":
            try:
                import zstandard
            except ImportError as e:
                raise DeltaFormatError(f"{where}: payload is zstd-compressed but 'zstandard' is not installed") from e
            return zstandard.ZstdDecompressor().decompress(data)
        if codec == "lzma":
            return lzma.decompress(data)
    except (lzma.LZMAError, ValueError) as e:
        if isinstance(e, DeltaFormatError):
            raise
        raise DeltaFormatError(f"{where}: corrupt {codec} payload: {e}") from e
    raise DeltaFormatError(f"{where}: unknown payload codec {codec!r}; want one of {sorted(PAYLOAD_FILES)}")


def default_codec() -> str:
    """The lossless codec ``--lossless`` uses: zstd when ``zstandard`` is importable, else stdlib lzma."""
    try:
        import zstandard  # noqa: F401
    except ImportError:
        return "lzma"
    return "zstd"


def write_delta_dir(
    out_dir: Path,
    manifest: dict[str, Any],
    packed: dict[str, PackedLinear],
    dense: dict[str, torch.Tensor],
    codec: str = "none",
) -> dict[str, Any]:
    """Write payload + manifest into ``out_dir`` (created; must be empty or absent); return the manifest.

    Fills ``manifest["payload"]`` and the payload sizes; files are written under temporary names
    and renamed at the end, so a failure leaves no half-written delta.
    """
    tensors: dict[str, torch.Tensor] = {}
    for name, p in packed.items():
        for suffix, t in p.tensors().items():
            tensors[f"{name}.{suffix}"] = t.detach().to("cpu").contiguous()
    for name, t in dense.items():
        if name in tensors:
            raise ValueError(f"delta tensor name collision: {name}")
        tensors[name] = t.detach().to("cpu", torch.float16).contiguous()
    raw = st_save(tensors, metadata={"format": FORMAT, "format_version": str(FORMAT_VERSION)})
    data = encode_payload(raw, codec)
    manifest = dict(manifest)
    manifest["payload"] = {"file": PAYLOAD_FILES[codec], "codec": codec, "bytes": len(data), "raw_bytes": len(raw)}
    sizes = dict(manifest.get("sizes", {}))
    sizes["payload_bytes"] = len(data)
    if sizes.get("finetuned_fp16_bytes"):
        sizes["compression_ratio"] = sizes["finetuned_fp16_bytes"] / len(data)
    manifest["sizes"] = sizes
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp_payload = out_dir / (PAYLOAD_FILES[codec] + ".tmp")
    tmp_manifest = out_dir / (MANIFEST + ".tmp")
    tmp_payload.write_bytes(data)
    tmp_manifest.write_text(json.dumps(manifest, indent=1) + "\n")
    tmp_payload.rename(out_dir / PAYLOAD_FILES[codec])
    tmp_manifest.rename(out_dir / MANIFEST)
    return manifest


def read_manifest(delta_dir: str | Path) -> dict[str, Any]:
    """Parse and sanity-check ``manifest.json`` (format, version, mode, required sections)."""
    delta_dir = Path(delta_dir)
    path = delta_dir / MANIFEST
    if not path.is_file():
        raise DeltaFormatError(f"{delta_dir}: no {MANIFEST} (expected a directory written by `deltaserve compress`)")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DeltaFormatError(f"{path}: not valid JSON: {e}") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DeltaFormatError(f"{path}: field 'format' must be {FORMAT!r}")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise DeltaFormatError(
            f"{path}: unsupported 'format_version' {manifest.get('format_version')!r} (this reader: {FORMAT_VERSION})"
        )
    if manifest.get("mode") not in MODES:
        raise DeltaFormatError(f"{path}: field 'mode' must be one of {list(MODES)}, got {manifest.get('mode')!r}")
    for key in ("base", "compression", "payload", "tensors"):
        if not isinstance(manifest.get(key), dict):
            raise DeltaFormatError(f"{path}: missing or malformed section '{key}'")
    return manifest


_ST_DTYPES = {"I32": torch.int32, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
              "I64": torch.int64, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16}  # fmt: skip
"""safetensors dtype tags a payload may hold (``deltaserve compress`` writes I32 and F16)."""


def _read_payload(
    paths: list[Path], codec: str, alloc: Callable[[int], torch.Tensor]
) -> tuple[dict[str, torch.Tensor], Path]:
    """The payload's tensors as views of one host buffer from ``alloc`` (module docstring) and the file
    later errors name (the first); DeltaFormatError if a file is not a well-formed safetensors payload.
    Several files (a block zoo's variant: one per own block) are read back to back into the one
    buffer, uncompressed only."""
    if codec == "none":
        sizes = [p.stat().st_size for p in paths]
        starts = [0]
        for size in sizes[:-1]:  # each file 16-byte aligned: its tensors stay views, never copies
            starts.append(-(-(starts[-1] + size) // 16) * 16)
        buf = alloc(starts[-1] + sizes[-1])
        spans = []
        for path, size, at in zip(paths, sizes, starts):
            with path.open("rb") as f:
                got = f.readinto(buf[at : at + size].numpy().data)
            if got != size:
                raise DeltaFormatError(f"{path}: read {got} of {size} bytes (the file changed while loading)")
            spans.append((path, at, at + size))
    else:
        if len(paths) != 1:
            raise DeltaFormatError(f"{paths[0].parent}: a payload of several files must be uncompressed (codec none)")
        raw = decode_payload(paths[0].read_bytes(), codec, str(paths[0]))
        buf = alloc(len(raw))
        buf.numpy()[:] = memoryview(raw)
        spans = [(paths[0], 0, len(raw))]
    tensors: dict[str, torch.Tensor] = {}
    for path, lo_file, hi_file in spans:
        for name, t in _parse_safetensors(buf[lo_file:hi_file], path).items():
            if name in tensors:
                raise DeltaFormatError(f"{path}: tensor '{name}' is also in another payload file")
            tensors[name] = t
    return tensors, paths[0]


def _parse_safetensors(buf: torch.Tensor, path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file held in ``buf`` (uint8) parsed in place: its tensors as views of ``buf``."""
    try:
        if len(buf) < 8:
            raise ValueError("truncated header")
        n = int.from_bytes(buf[:8].numpy().tobytes(), "little")
        if 8 + n > len(buf):
            raise ValueError("truncated header")
        header = json.loads(bytes(buf[8 : 8 + n].numpy()))
        start = 8 + n
        tensors = {}
        for name, e in header.items():
            if name == "__metadata__":
                continue
            dtype, shape, (lo, hi) = _ST_DTYPES[e["dtype"]], [int(d) for d in e["shape"]], e["data_offsets"]
            if not 0 <= lo <= hi <= len(buf) - start or hi - lo != math.prod(shape) * dtype.itemsize:
                raise ValueError(f"tensor '{name}': data offsets {lo}..{hi} do not fit {e['dtype']} {shape}")
            view = buf[start + lo : start + hi]
            if view.data_ptr() % dtype.itemsize:  # misaligned for the dtype: a copy (never for our writer)
                view = view.clone()
            tensors[name] = view.view(dtype).reshape(shape)
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise DeltaFormatError(f"{path}: not a valid safetensors payload: {e}") from e
    return tensors


def load_delta(
    delta_dir: str | Path, device: torch.device | str = "cpu", alloc: Callable[[int], torch.Tensor] | None = None
) -> tuple[dict[str, Any], dict[str, PackedLinear], dict[str, torch.Tensor]]:
    """Read a delta directory: ``(manifest, {hf module name: PackedLinear}, {tensor name: float16 tensor})``.

    Validates every manifest entry against the payload (presence, shapes, packed layout) and
    refuses payload tensors the manifest does not list. The host tensors are views of one buffer
    ``alloc(nbytes)`` returns (uint8 [nbytes] in host memory; default a new pageable one): the worker
    passes its pinned arena's (``adapters/pinned_arena.py``).
    """
    delta_dir = Path(delta_dir)
    manifest = read_manifest(delta_dir)
    payload = manifest["payload"]
    codec = payload.get("codec", "none")
    names = payload.get("files") if "files" in payload else [payload.get("file", "")]
    if not isinstance(names, list) or not names:
        raise DeltaFormatError(f"{delta_dir / MANIFEST}: field 'payload.files' must be a non-empty list")
    paths = [delta_dir / str(n) for n in names]
    for n, f in zip(names, paths):
        # A plain name inside the directory (the file itself may be a link, as the benchmarks'
        # shared payloads are; where links may lead is the router's --adapter-root rule).
        if Path(str(n)).name != str(n) or str(n) in ("", ".", "..") or not f.is_file():
            raise DeltaFormatError(f"{delta_dir}: payload file '{n}' named in {MANIFEST} is missing")
    tensors, path = _read_payload(paths, codec, alloc or (lambda n: torch.empty(n, dtype=torch.uint8)))
    comp = manifest["compression"]
    bits, group = int(comp["bits"]), int(comp["group_size"])
    sparse = comp["sparsity"] == "2:4"
    packed: dict[str, PackedLinear] = {}
    dense: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    for name, entry in manifest["tensors"].items():
        shape = list(entry.get("shape", []))
        if entry.get("kind") == "packed":
            parts = {}
            for suffix in PACKED_SUFFIXES:
                key = f"{name}.{suffix}"
                if key in tensors:
                    parts[suffix] = tensors[key]
                    used.add(key)
                elif suffix != "qindices" or sparse:
                    raise DeltaFormatError(f"{path}: packed linear '{name}' lacks tensor '{key}'")
            if len(shape) != 2:
                raise DeltaFormatError(f"{delta_dir / MANIFEST}: packed '{name}' needs a 2-D shape, got {shape}")
            try:
                p = PackedLinear(
                    bits=bits, sparse=sparse, group_size=group, out_features=shape[0], in_features=shape[1],
                    qvalues=parts["qvalues"], qindices=parts.get("qindices"),
                    scales=parts["scales"], zeros=parts["zeros"],
                )  # fmt: skip
            except ValueError as e:
                raise DeltaFormatError(f"{path}: packed linear '{name}': {e}") from e
            packed[name] = p.to(device)
        elif entry.get("kind") == "dense":
            if name not in tensors:
                raise DeltaFormatError(f"{path}: dense tensor '{name}' listed in {MANIFEST} is missing")
            t = tensors[name]
            used.add(name)
            if list(t.shape) != shape:
                raise DeltaFormatError(
                    f"{path}: dense tensor '{name}' has shape {list(t.shape)}, manifest says {shape}"
                )
            dense[name] = t.to(device)
        else:
            raise DeltaFormatError(f"{delta_dir / MANIFEST}: tensor '{name}' has unknown kind {entry.get('kind')!r}")
    extra = sorted(set(tensors) - used)
    if extra:
        raise DeltaFormatError(f"{path}: tensors not listed in {MANIFEST}: {', '.join(extra[:5])}")
    return manifest, packed, dense


def materialize(
    delta_dir: str | Path, base_dir: str | Path, out_dir: str | Path, dtype: torch.dtype = torch.float32
) -> Path:
    """Write ``W_base + dequant(Δ̃)`` (mode "delta") or ``dequant(W̃)`` (mode "full") as an HF directory.

    The reference model of tests and evaluations (it holds the whole model in memory). Config and
    tokenizer files are copied from ``base_dir``; lineage is checked first.
    """
    from ..formats.packed_delta import dequantize

    delta_dir, base_dir, out_dir = Path(delta_dir), Path(base_dir), Path(out_dir)
    manifest, packed, dense = load_delta(delta_dir)
    check_lineage(manifest, base_dir, delta_dir)
    full = manifest["mode"] == "full"
    located = checkpoint_shapes(base_dir)
    out: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for name, (f, _) in located.items():
        by_file.setdefault(f, []).append(name)
    for f, names in by_file.items():
        with safe_open(f, framework="pt") as sf:
            for name in names:
                out[name] = sf.get_tensor(name).to(torch.float32)
    for module, p in packed.items():
        key = f"{module}.weight"
        d = dequantize(p, torch.float32)
        out[key] = d if full else out[key] + d
    for name, t in dense.items():
        out[name] = t.float() if full else out.get(name, torch.zeros(t.shape)) + t.float()
    out_dir.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    save_file({k: v.to(dtype).contiguous() for k, v in out.items()}, str(out_dir / "model.safetensors"))
    for fname in _HF_FILES:
        if (base_dir / fname).is_file():
            shutil.copyfile(base_dir / fname, out_dir / fname)
    return out_dir
