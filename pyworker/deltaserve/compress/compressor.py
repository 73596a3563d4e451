"""The ΔCompress driver (DeltaZip Algorithm 1): base + full fine-tune -> delta directory, one layer at a time.

Flow, with the repo's own decoder (``model.decoder.DecoderLayer``, the fused ``qkv_proj`` /
``gate_up_proj`` sliced per ``linear_slots``)::

    check base vs fine-tuned: config fields (model_signature) and every tensor shape
    samples  = calibration_samples(--calib or the built-in texts)    ragged chunks of ForwardBatch
    E~       = W_base + fp16(Δ_embed)                                dense tensors: fp16 deltas
    h        = E~[tokens]                                            per chunk, on --device
    for layer l:
        build one DecoderLayer: norms/biases = base + fp16(Δ) ; linears = W_ft (placeholders)
        for group in (qkv_proj, o_proj, gate_up_proj, down_proj):    forward order ("true sequential")
            H  = (2/n) Σ x xᵀ over the group's input x               forward stops at the group's hook
            for each HF linear of the group (q, k, v | o | gate, up | down):
                Δ  = W_ft − W_base                                   rows of the fused weight
                Q, M, scales, zeros = obs_compress(Δ, H)             SparseGPT/OBS 2:4 + group quant
                fused rows ← W_base + dequant(Q⊙M)                   the *reconstructed* layer
        h, residual = layer(h, residual)                             inputs of layer l+1
    final norm, lm_head: dense fp16 deltas (dropped when exactly zero)

``--full-weights`` runs the same pipeline with ``W_base := 0`` (SparseGPT on the fine-tuned weights,
the paper's baseline) and stores full tensors (``manifest["mode"] = "full"``).

Memory: one layer's weights (base and fine-tuned tensors read lazily from the safetensors files),
its Hessians, and the calibration hidden states (tokens × hidden × 2, float32) on the device; the
packed results (a fraction of the fp16 model) accumulate on the CPU until the payload is written.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.nn.functional as F
from safetensors import safe_open

from ..formats.packed_delta import PackedLinear, pack
from ..model.arch import ModelConfig
from ..model.attention import AttentionMeta, attention_metadata
from ..model.batch import ForwardBatch
from ..model.decoder import DecoderLayer, DecoderLM, embed_scale, linear_slots
from ..model.kv_cache import PagedKVCache
from ..model.rope import RopeTables
from .calib import calibration_samples, load_calibration
from .delta_dir import (
    FORMAT,
    FORMAT_VERSION,
    DeltaLineageError,
    as_json,
    checkpoint_shapes,
    compare_signatures,
    default_codec,
    model_signature,
    signature_hash,
    write_delta_dir,
)
from .obs import DEFAULT_BLOCK_SIZE, DEFAULT_PERCDAMP, layer_objective, obs_compress

_KV_BLOCK = 16
"""Tokens per page of the scratch KV cache the calibration forwards write into."""


@dataclass(frozen=True)
class CompressConfig:
    """Settings of one compression run (the CLI flags of ``python -m deltaserve.compress``)."""

    bits: int = 4
    """Bits per stored value: 4 or 2."""
    sparse: bool = True
    """2:4 sparsity along the input dimension (``--sparsity 2:4``) or dense (``none``)."""
    group_size: int = 64
    """Input columns per (scale, zero); must divide every linear's in_features."""
    calib: str | None = None
    """JSONL calibration file (``calib`` module); None = the built-in texts."""
    nsamples: int = 128
    """Most calibration sequences used."""
    seqlen: int = 512
    """Longest calibration sequence (longer texts are split into windows)."""
    device: str = "cpu"
    """Where layers, Hessians and the solver run: "cpu" or "cuda[:N]"."""
    lossless: bool = False
    """Compress the payload losslessly (``delta_dir.default_codec``: zstd if installed, else lzma)."""
    full_weights: bool = False
    """Compress W_ft itself instead of the delta (the SparseGPT baseline; manifest mode "full")."""
    block_size: int = DEFAULT_BLOCK_SIZE
    """OBS column block."""
    percdamp: float = DEFAULT_PERCDAMP
    """Hessian damping, fraction of the mean diagonal."""
    chunk_tokens: int = 4096
    """Calibration tokens per forward chunk (bounds attention scratch memory)."""
    only: frozenset[str] | None = None
    """HF tensor names taken from the fine-tune; every other tensor is the base's (its delta is zero:
    packed linears left out, dense ones dropped). None: all of them. The block zoo compresses a
    variant's own blocks this way (``deltaserve.zoo``); the manifest then says ``"partial": true``."""

    def validate(self) -> None:
        """Raise ``ValueError`` naming the bad setting."""
        if self.bits not in (2, 4):
            raise ValueError(f"--bits must be 2 or 4, got {self.bits}")
        if self.group_size <= 0 or self.group_size % 4 != 0:
            raise ValueError(f"--group-size must be a positive multiple of 4, got {self.group_size}")
        if self.nsamples < 1 or self.seqlen < 2:
            raise ValueError(f"--nsamples must be >= 1 and --seqlen >= 2, got {self.nsamples}, {self.seqlen}")
        if not 0 <= self.percdamp < 1:
            raise ValueError(f"percdamp must be in [0, 1), got {self.percdamp}")
        if self.block_size < 1 or self.chunk_tokens < 1:
            raise ValueError("block_size and chunk_tokens must be >= 1")
        dev = torch.device(self.device)
        if dev.type not in ("cpu", "cuda"):
            raise ValueError(f"--device must be cpu or cuda, got {self.device!r}")
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"--device {self.device}: CUDA is not available on this machine")


@dataclass
class _Checkpoint:
    """Lazy, per-tensor access to an HF directory's safetensors (headers read once, files kept open)."""

    model_dir: Path
    """The HF directory."""
    located: dict[str, tuple[Path, tuple[int, ...]]] = field(default_factory=dict)
    """Tensor name -> (file, shape)."""
    _handles: dict[Path, Any] = field(default_factory=dict)
    """Open ``safe_open`` handles per file."""

    def __post_init__(self) -> None:
        self.located = checkpoint_shapes(self.model_dir)

    def get(self, name: str, device: torch.device) -> torch.Tensor:
        """One tensor as float32 on ``device``."""
        f = self.located[name][0]
        if f not in self._handles:
            self._handles[f] = safe_open(f, framework="pt")
        return self._handles[f].get_tensor(name).to(device=device, dtype=torch.float32)


@dataclass
class _Restricted:
    """A fine-tune restricted to ``only``: those tensors from ``ft``, every other one from ``base``."""

    ft: _Checkpoint
    base: _Checkpoint
    only: frozenset[str]

    @property
    def located(self) -> dict[str, tuple[Path, tuple[int, ...]]]:
        return self.ft.located

    @property
    def model_dir(self) -> Path:
        return self.ft.model_dir

    def get(self, name: str, device: torch.device) -> torch.Tensor:
        return (self.ft if name in self.only else self.base).get(name, device)


@dataclass
class _Chunk:
    """One ragged batch of calibration sequences and its per-forward attention state."""

    batch: ForwardBatch
    """Prefill of whole sequences (positions from 0)."""
    meta: AttentionMeta
    """Attention metadata, built once and reused by every layer."""


def _chunks(
    samples: list[list[int]], max_tokens: int, cfg: ModelConfig, device: torch.device
) -> tuple[list[_Chunk], int]:
    """Group samples into chunks of at most ``max_tokens`` tokens (one sample minimum); also the pages needed."""
    groups: list[list[list[int]]] = [[]]
    count = 0
    for s in samples:
        if groups[-1] and count + len(s) > max_tokens:
            groups.append([])
            count = 0
        groups[-1].append(s)
        count += len(s)
    chunks, most_pages = [], 1
    for group in groups:
        seqs, page = [], 0
        for s in group:
            n_pages = -(-len(s) // _KV_BLOCK)
            seqs.append((s, 0, list(range(page, page + n_pages)), False))
            page += n_pages
        most_pages = max(most_pages, page)
        batch = ForwardBatch.build(seqs, _KV_BLOCK, device)
        chunks.append(_Chunk(batch, attention_metadata(batch, _KV_BLOCK, cfg.sliding_window)))
    return chunks, most_pages


class _StopForward(Exception):
    """Raised by a capture hook once it has its input: the rest of the layer need not run."""


def _bar(done: int, total: int, width: int = 24) -> str:
    filled = int(width * done / max(total, 1))
    return "[" + "#" * filled + "." * (width - filled) + f"] {done}/{total}"


def compress(
    base_dir: str | Path,
    finetuned_dir: str | Path,
    out_dir: str | Path,
    config: CompressConfig = CompressConfig(),
    progress: TextIO | None = sys.stderr,
) -> dict[str, Any]:
    """Compress ``finetuned_dir`` against ``base_dir`` into the delta directory ``out_dir``; return its manifest.

    Refuses (``ValueError``) mismatched architectures/shapes, a non-empty ``out_dir`` and bad
    settings before any work; writes nothing unless it completes.
    """
    t_start = time.monotonic()
    config.validate()
    base_dir, finetuned_dir, out_dir = Path(base_dir), Path(finetuned_dir), Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ValueError(f"--out {out_dir}: exists and is not an empty directory (refusing to overwrite)")
    device = torch.device(config.device)
    full = config.full_weights

    base_cfg = ModelConfig.from_model_dir(base_dir)
    ft_cfg = ModelConfig.from_model_dir(finetuned_dir)
    base_sig, ft_sig = as_json(model_signature(base_cfg)), as_json(model_signature(ft_cfg))
    compare_signatures(base_sig, ft_sig, f"base {base_dir}", f"fine-tuned model {finetuned_dir}")

    with torch.device("meta"):
        layout = DecoderLM(base_cfg, dtype=torch.float32).checkpoint_layout()
    base_ck, whole_ft_ck = _Checkpoint(base_dir), _Checkpoint(finetuned_dir)
    ft_ck = whole_ft_ck if config.only is None else _Restricted(whole_ft_ck, base_ck, config.only)
    tied = base_cfg.tie_word_embeddings or "lm_head.weight" not in base_ck.located
    names = [n for n in layout if not (tied and n == "lm_head.weight")]
    for name in names:
        want = layout[name][2]
        for what, ck in (("base", base_ck), ("fine-tuned", ft_ck)):
            if name not in ck.located:
                raise DeltaLineageError(f"{what} model {ck.model_dir} lacks tensor '{name}'")
            if ck.located[name][1] != want:
                raise DeltaLineageError(
                    f"{ck.located[name][0]}: tensor '{name}' has shape {list(ck.located[name][1])}, "
                    f"expected {list(want)} (the {what} config.json)"
                )
    slots = linear_slots(base_cfg)
    for name, slot in slots.items():  # every linear must fit the packed format before any work
        in_f = layout[f"model.layers.0.{slot.module.rpartition('.')[0]}.{name}.weight"][2][1]
        if in_f % config.group_size:
            raise ValueError(f"--group-size {config.group_size} does not divide {name}'s in_features {in_f}")
        if config.sparse and in_f % 32:
            raise ValueError(f"2:4 sparsity needs in_features % 32 == 0 (packed indices); {name} has {in_f}")
        if (in_f * config.bits) % 32:
            raise ValueError(f"{name}: {in_f} values x {config.bits} bits per row do not fill int32 words")
    if tied and "lm_head.weight" in ft_ck.located:  # the base ties lm_head: the variant must too
        cpu = torch.device("cpu")
        if not torch.equal(ft_ck.get("lm_head.weight", cpu), ft_ck.get("model.embed_tokens.weight", cpu)):
            raise DeltaLineageError(
                f"fine-tuned model {finetuned_dir} has its own lm_head.weight, but the base {base_dir} ties "
                f"lm_head to embed_tokens: the delta cannot express an untied head"
            )

    items = load_calibration(config.calib)
    samples = calibration_samples(
        items, base_dir, config.nsamples, config.seqlen, base_cfg.vocab_size, base_cfg.bos_token_id
    )
    chunks, pages = _chunks(samples, config.chunk_tokens, base_cfg, device)
    kv = PagedKVCache(1, pages, _KV_BLOCK, base_cfg.num_kv_heads, base_cfg.head_dim, torch.float32, device)
    cos_sin = RopeTables.build(base_cfg, max(len(s) for s in samples), device, torch.float32)
    n_tokens = sum(len(s) for s in samples)
    log = (lambda msg: print(msg, file=progress, flush=True)) if progress is not None else (lambda msg: None)
    log(
        f"deltaserve compress: {'full weights' if full else 'delta'} {finetuned_dir.name} vs {base_dir.name}, "
        f"{config.bits}-bit {'2:4' if config.sparse else 'dense'}, group {config.group_size}, "
        f"{len(samples)} calibration samples ({n_tokens} tokens), device {device}"
    )

    packed: dict[str, PackedLinear] = {}
    dense: dict[str, torch.Tensor] = {}
    entries: dict[str, dict[str, Any]] = {}
    dropped: list[str] = []

    def dense_tensor(name: str) -> torch.Tensor:
        """The reconstructed value of a non-compressed tensor; records its fp16 delta (or full value)."""
        ft = ft_ck.get(name, device)
        if full:
            stored = ft.to(torch.float16)
            recon = stored.float()
        else:
            base = base_ck.get(name, device)
            diff = ft - base
            if not bool(diff.any()):
                dropped.append(name)
                return base
            stored = diff.to(torch.float16)
            recon = base + stored.float()
        dense[name] = stored.cpu()
        entries[name] = {"kind": "dense", "shape": list(stored.shape), "bytes": stored.numel() * 2}
        return recon

    with torch.no_grad():
        embed = dense_tensor("model.embed_tokens.weight")
        states: list[tuple[torch.Tensor, torch.Tensor | None]] = [
            (F.embedding(c.batch.input_ids, embed) * (embed_scale(base_cfg, torch.float32) or 1.0), None)
            for c in chunks
        ]
        del embed
        groups: dict[str, list[str]] = {}
        for name, slot in slots.items():
            groups.setdefault(slot.module, []).append(name)
        n_layers = base_cfg.num_layers
        for li in range(n_layers):
            t_layer = time.monotonic()
            prefix = f"model.layers.{li}."
            with torch.device("meta"):
                layer = DecoderLayer(base_cfg, torch.float32, li)
            layer.to_empty(device=device)
            layer.eval()
            params = dict(layer.named_parameters())
            linear_weights = {f"{prefix}{s.module.rpartition('.')[0]}.{n}.weight" for n, s in slots.items()}
            for hf_name, (pname, start, shape) in layout.items():
                if not hf_name.startswith(prefix):
                    continue
                value = ft_ck.get(hf_name, device) if hf_name in linear_weights else dense_tensor(hf_name)
                params[pname[len(prefix) :]][start : start + shape[0]].copy_(value)
            errors: list[str] = []
            for module_path, hf_linears in groups.items():
                hessian = _collect_hessian(layer, module_path, chunks, states, cos_sin, kv)
                # The linears of one fused module share their input, hence H: OBS treats rows
                # independently, so compressing their stacked rows at once equals one call each.
                parent = module_path.rpartition(".")[0]
                modules = [f"{prefix}{parent}.{name}" for name in hf_linears]
                if config.only is not None and not any(f"{m}.weight" in config.only for m in modules):
                    continue  # the base's weights, placed above: no delta, no Hessian needed
                w_ft = torch.cat([ft_ck.get(f"{m}.weight", device) for m in modules])
                if full:
                    w_base = torch.zeros_like(w_ft)
                else:
                    w_base = torch.cat([base_ck.get(f"{m}.weight", device) for m in modules])
                target = w_ft - w_base
                res = obs_compress(
                    target, hessian, config.bits, config.sparse, config.group_size,
                    block_size=config.block_size, percdamp=config.percdamp,
                )  # fmt: skip
                fused = params[f"{module_path}.weight"]
                row = 0
                for name, module in zip(hf_linears, modules):
                    slot = slots[name]
                    rows = slice(row, row + slot.size)
                    row += slot.size
                    if config.only is not None and f"{module}.weight" not in config.only:
                        fused[slot.start : slot.start + slot.size].copy_(w_base[rows])
                        continue
                    fused[slot.start : slot.start + slot.size].copy_(w_base[rows] + res.dequant[rows])
                    p = pack(
                        res.codes[rows], None if res.mask is None else res.mask[rows],
                        res.scales[rows], res.zeros[rows], config.bits, config.group_size,
                    ).to("cpu")  # fmt: skip
                    rel = layer_objective(target[rows], res.dequant[rows], hessian)
                    packed[module] = p
                    entries[module] = {
                        "kind": "packed",
                        "shape": [p.out_features, p.in_features],
                        "bytes": p.nbytes(),
                        "rel_error": rel,
                    }
                    errors.append(f"{name.removesuffix('_proj')} {rel:.3g}")
                del w_ft, w_base, target, res
                del hessian
            states = [_run_layer(layer, c, st, cos_sin, kv) for c, st in zip(chunks, states)]
            del layer, params
            log(f"layer {_bar(li + 1, n_layers)} {time.monotonic() - t_layer:.1f}s  rel.err " + ", ".join(errors))
        del states
        dense_tensor("model.norm.weight")
        if not tied:
            dense_tensor("lm_head.weight")

    fp16_bytes = sum(2 * _numel(layout[n][2]) for n in names)
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "mode": "full" if full else "delta",
        "base": {"name": base_dir.resolve().name, "config": base_sig, "config_sha256": signature_hash(base_sig)},
        "finetuned": {"name": finetuned_dir.resolve().name, "config_sha256": signature_hash(ft_sig)},
        "base_shapes": {n: list(layout[n][2]) for n in names},
        "compression": {
            "bits": config.bits,
            "sparsity": "2:4" if config.sparse else "none",
            "group_size": config.group_size,
            "method": "obs",
            "block_size": config.block_size,
            "percdamp": config.percdamp,
            "calibration": {
                "source": str(config.calib) if config.calib else "builtin",
                "samples": len(samples),
                "tokens": n_tokens,
                "seqlen": config.seqlen,
            },
        },
        "tensors": entries,
        "dropped": dropped,
        "sizes": {"finetuned_fp16_bytes": fp16_bytes},
        "seconds": None,
    }
    if config.only is not None:
        manifest["partial"] = True  # block linears without a packed delta are the base's
    manifest["seconds"] = round(time.monotonic() - t_start, 3)
    codec = default_codec() if config.lossless else "none"
    return write_delta_dir(out_dir, manifest, packed, dense, codec)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _run_layer(
    layer: DecoderLayer,
    chunk: _Chunk,
    state: tuple[torch.Tensor, torch.Tensor | None],
    cos_sin: RopeTables,
    kv: PagedKVCache,
) -> tuple[torch.Tensor, torch.Tensor]:
    h, residual = state
    return layer(h, residual, cos_sin, chunk.batch, chunk.meta, kv.k[0], kv.v[0])


def _collect_hessian(
    layer: DecoderLayer,
    module_path: str,
    chunks: list[_Chunk],
    states: list[tuple[torch.Tensor, torch.Tensor | None]],
    cos_sin: RopeTables,
    kv: PagedKVCache,
) -> torch.Tensor:
    """``(2/n) Σ x xᵀ`` over the inputs of ``layer.<module_path>`` for every calibration token."""
    module = layer.get_submodule(module_path)
    weight = layer.get_parameter(f"{module_path}.weight")
    in_f = weight.shape[1]
    hessian = torch.zeros(in_f, in_f, dtype=torch.float32, device=weight.device)
    n = 0

    def hook(_mod: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        nonlocal n
        x = args[0].reshape(-1, in_f).to(torch.float32)
        hessian.addmm_(x.T, x)
        n += x.shape[0]
        raise _StopForward

    handle = module.register_forward_pre_hook(hook)
    try:
        for chunk, state in zip(chunks, states):
            try:
                _run_layer(layer, chunk, state, cos_sin, kv)
            except _StopForward:
                pass
    finally:
        handle.remove()
    return hessian * (2.0 / max(n, 1))


def format_report(manifest: dict[str, Any], per_tensor: bool = True) -> str:
    """The printed report: per-tensor sizes, totals and the compression ratio vs the fp16 fine-tune."""
    lines = []
    if per_tensor:
        width = max((len(n) for n in manifest["tensors"]), default=10)
        lines.append(f"{'tensor':<{width}}  {'kind':<6}  {'shape':<14}  {'bytes':>12}  {'fp16 bytes':>12}  rel.err")
        for name, e in manifest["tensors"].items():
            fp16 = 2 * _numel(tuple(e["shape"]))
            err = f"{e['rel_error']:.4g}" if "rel_error" in e else "-"
            shape = "x".join(str(d) for d in e["shape"])
            lines.append(f"{name:<{width}}  {e['kind']:<6}  {shape:<14}  {e['bytes']:>12,}  {fp16:>12,}  {err}")
    sizes, payload = manifest["sizes"], manifest["payload"]
    comp = manifest["compression"]
    n_packed = sum(1 for e in manifest["tensors"].values() if e["kind"] == "packed")
    n_dense = len(manifest["tensors"]) - n_packed
    lines += [
        f"mode {manifest['mode']}: {comp['bits']}-bit, sparsity {comp['sparsity']}, group {comp['group_size']}; "
        f"{n_packed} packed linears, {n_dense} dense tensors, {len(manifest['dropped'])} zero deltas dropped",
        f"payload {payload['file']} ({payload['codec']}): {payload['bytes']:,} bytes "
        f"(raw {payload['raw_bytes']:,}); fine-tuned model in fp16: {sizes['finetuned_fp16_bytes']:,} bytes",
        f"compression ratio vs fp16: {sizes['compression_ratio']:.2f}x"
        f"  (raw payload: {sizes['finetuned_fp16_bytes'] / payload['raw_bytes']:.2f}x)"
        f"  in {manifest['seconds']:.1f}s",
    ]
    return "\n".join(lines)
