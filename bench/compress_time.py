"""Wall time and compression ratio of ``deltaserve compress`` (DeltaZip's ΔCompress: the real
``compress/compressor.compress``) on a Llama-2-7B-shaped full fine-tune, on one GPU.

Inputs, written first (not timed against the target):
  base       a random fp16 checkpoint of the shape (``common.write_random_checkpoint``: N(0, 0.02)
             matrices, norms 1), drawn on the GPU and written as safetensors shards;
  fine-tune  the same tensors plus ``--noise`` x their scale of Gaussian noise (every tensor changes,
             as in a full fine-tune);
  calib      ``--nsamples`` sequences of ``--seqlen`` random token ids (a JSONL of ``input_ids``: the
             random base has no tokenizer for the built-in texts; the compressor's work depends on
             the token count, not on the text).
Timed: one ``compress()`` call with ``CompressConfig(device="cuda")``: reading both checkpoints (just
written, so mostly from the page cache), the calibration forwards, Hessians, OBS 2:4 pruning and
group quantization of every block linear, packing and writing the payload. Per-layer times come
from the compressor's own progress lines. Reported: seconds, per-layer seconds, the manifest's
compression ratio vs the fp16 fine-tune and payload bytes, and the mean / max relative layer error.

``--num-layers N`` compresses the shape with only N decoder layers (same widths) and extrapolates
to the full depth: measured seconds + mean seconds per layer x (full layers - N). Every layer does
the same work, so this bounds a run that would not fit a short session.
Target: <= 15 minutes for the 7B shape, 4-bit 2:4, on one GPU (``target.seconds_full_depth``).

    python3 -m bench.compress_time [--shape llama-2-7b] [--num-layers N] [--bits 4] [--sparsity 2:4]
        [--nsamples 128] [--seqlen 512] [--lossless] [--workdir DIR] [--out DIR]
    python3 -m bench.compress_time --smoke [--out DIR]    # tiny shape on the CPU: checks the script

Disk: two fp16 checkpoints and the delta (~30 GB for 7B) under ``--workdir`` (default: a temp dir).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench import script_env

script_env.prepare()  # deltaserve importable from pyworker/

from bench.common import SHAPES, SMOKE_SHAPE, device_name, shape_config, write_random_checkpoint, write_result  # noqa: E402
from deltaserve.compress.compressor import CompressConfig, compress  # noqa: E402

TARGET_SECONDS = 15 * 60
"""Target: compressing the full-depth shape takes at most this long on one GPU."""
SMOKE = {"nsamples": 4, "seqlen": 32, "num_layers": 1}
"""``--smoke`` overrides (with ``SMOKE_SHAPE`` on the CPU; one of its two layers, extrapolated)."""


class LayerClock:
    """The ``progress`` stream handed to ``compress``: echoes to stderr and notes when each line ends,
    so a layer's time is the gap between its progress line and the line before it."""

    def __init__(self) -> None:
        self.lines: list[tuple[float, str]] = []
        self._partial = ""

    def write(self, text: str) -> int:
        sys.stderr.write(text)
        self._partial += text
        while "\n" in self._partial:
            line, self._partial = self._partial.split("\n", 1)
            self.lines.append((time.monotonic(), line))
        return len(text)

    def flush(self) -> None:
        sys.stderr.flush()

    def layer_seconds(self) -> list[float]:
        """Seconds between consecutive progress lines, for each line that reports a finished layer."""
        out = []
        for (t_prev, _), (t, line) in zip(self.lines, self.lines[1:]):
            if line.startswith("layer "):
                out.append(t - t_prev)
        return out


def write_calibration(path: Path, nsamples: int, seqlen: int, vocab_size: int, seed: int = 0) -> Path:
    """``nsamples`` lines of ``{"input_ids": [...]}`` with ``seqlen`` random ids in [3, vocab)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab_size, (nsamples, seqlen), generator=g)
    path.write_text("".join(json.dumps({"input_ids": row}) + "\n" for row in ids.tolist()))
    return path


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama-2-7b", choices=sorted(SHAPES))
    p.add_argument(
        "--num-layers",
        type=int,
        default=None,
        help="compress only this many decoder layers and extrapolate to the shape's depth",
    )
    p.add_argument("--bits", type=int, choices=(2, 4), default=4)
    p.add_argument("--sparsity", choices=("2:4", "none"), default="2:4")
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--nsamples", type=int, default=128)
    p.add_argument("--seqlen", type=int, default=512)
    p.add_argument("--noise", type=float, default=0.01, help="fine-tune noise relative to each tensor's scale")
    p.add_argument("--lossless", action="store_true", help="also compress the payload losslessly (zstd/lzma)")
    p.add_argument("--device", default="cuda", help="where compress runs (default cuda)")
    p.add_argument(
        "--workdir", type=Path, default=None, help="where the checkpoints and delta go (default: a temp dir)"
    )
    p.add_argument("--smoke", action="store_true", help="tiny shape on the CPU (checks the script runs)")
    p.add_argument("--out", type=Path, default=None, help="result directory (default bench/results)")
    args = p.parse_args(argv)
    if args.smoke:
        args.shape, args.device = SMOKE_SHAPE, "cpu"
        for k, v in SMOKE.items():
            setattr(args, k, v)
    return args


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("compress_time.py needs a CUDA device (or --smoke for a CPU check of the script)")
    full_layers = SHAPES[args.shape]["num_hidden_layers"]
    config = shape_config(args.shape, args.num_layers)
    layers = config["num_hidden_layers"]
    cfg = CompressConfig(
        bits=args.bits,
        sparse=args.sparsity == "2:4",
        group_size=args.group_size,
        nsamples=args.nsamples,
        seqlen=args.seqlen,
        device=args.device,
        lossless=args.lossless,
    )
    try:
        cfg.validate()
    except ValueError as e:
        raise SystemExit(f"compress_time.py: {e}") from e
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        root = Path(tmp)
        gen_device = "cuda" if device.type == "cuda" else "cpu"
        t0 = time.perf_counter()
        base = write_random_checkpoint(config, root / "base", seed=0, device=gen_device)
        finetuned = write_random_checkpoint(config, root / "finetuned", seed=0, noise=args.noise, device=gen_device)
        calib = write_calibration(root / "calib.jsonl", args.nsamples, args.seqlen, config["vocab_size"])
        setup = time.perf_counter() - t0
        print(f"base + fine-tune ({layers} layers) and calibration written in {setup:.1f} s", flush=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        clock = LayerClock()
        t0 = time.perf_counter()
        manifest = compress(base, finetuned, root / "delta", dataclasses.replace(cfg, calib=str(calib)), progress=clock)
        seconds = time.perf_counter() - t0
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    per_layer = clock.layer_seconds()
    if len(per_layer) != layers:
        raise SystemExit(f"expected {layers} layer progress lines from compress, got {len(per_layer)}")
    mean_layer = statistics.mean(per_layer)
    full_seconds = seconds + mean_layer * (full_layers - layers)
    errors = [e["rel_error"] for e in manifest["tensors"].values() if e["kind"] == "packed"]
    sizes, calib_info = manifest["sizes"], manifest["compression"]["calibration"]
    target = {
        "max_seconds": TARGET_SECONDS,
        "seconds_full_depth": full_seconds,
        "extrapolated": layers != full_layers,
        "met": full_seconds <= TARGET_SECONDS,
    }
    print(
        f"compress {args.shape} ({layers}/{full_layers} layers, {args.bits}-bit {args.sparsity}, "
        f"{calib_info['samples']} x {args.seqlen} calibration tokens on {device}): {seconds:.1f} s, "
        f"{mean_layer:.2f} s/layer -> {full_seconds / 60:.1f} min at full depth; ratio "
        f"{sizes['compression_ratio']:.2f}x vs fp16; target <= {TARGET_SECONDS // 60} min "
        f"{'met' if target['met'] else 'NOT met'}",
        flush=True,
    )
    path = write_result(
        "compress_time",
        {
            "device": device_name(device),
            "shape": args.shape,
            "smoke": args.smoke,
            "layers": layers,
            "full_layers": full_layers,
            "bits": args.bits,
            "sparsity": args.sparsity,
            "group_size": args.group_size,
            "nsamples": args.nsamples,
            "seqlen": args.seqlen,
            "calibration_samples": calib_info["samples"],
            "calibration_tokens": calib_info["tokens"],
            "noise": args.noise,
            "lossless": args.lossless,
            "compress_device": str(device),
            "setup_seconds": setup,
            "seconds": seconds,
            "layer_seconds": per_layer,
            "mean_layer_seconds": mean_layer,
            "seconds_full_depth": full_seconds,
            "peak_gpu_bytes": peak,
            "compression_ratio": sizes["compression_ratio"],
            "payload_bytes": sizes["payload_bytes"],
            "raw_payload_bytes": manifest["payload"]["raw_bytes"],
            "finetuned_fp16_bytes": sizes["finetuned_fp16_bytes"],
            "codec": manifest["payload"]["codec"],
            "rel_error_mean": statistics.mean(errors),
            "rel_error_max": max(errors),
            "target": target,
        },
        args.out,
    )
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
