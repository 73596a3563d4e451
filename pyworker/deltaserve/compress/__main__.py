"""``python -m deltaserve.compress``: the command line of ΔCompress (``deltaserve compress`` execs it).

    python -m deltaserve.compress --base DIR --finetuned DIR --out DIR [--bits 2|4]
        [--sparsity 2:4|none] [--group-size 64] [--calib FILE.jsonl] [--lossless]
        [--device cpu|cuda] [--nsamples N] [--seqlen L] [--full-weights]

Progress goes to stderr, the size report to stdout. Exit codes: 0 done, 2 bad arguments or inputs
(the message names the flag, file, field or tensor; nothing is written).

``help.txt`` beside this file is :func:`help_text` written out, so that ``deltaserve compress
--help`` prints it from the daemon binary without a working Python (``python -m
deltaserve.compress --write-help`` rewrites it; tests/test_compress_help.py checks it is current).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HELP_FILE = Path(__file__).with_name("help.txt")
"""The help text as the daemon binary embeds it."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="deltaserve compress",
        # A fixed width: the help text is the same on every terminal, and in help.txt.
        formatter_class=lambda prog: argparse.HelpFormatter(prog, width=100, max_help_position=32),
        description="Compress a full fine-tune into a 2:4-sparse, 2/4-bit delta against its base (DeltaZip ΔCompress).",
    )
    p.add_argument("--base", required=True, help="base model: HF dir (config.json, *.safetensors, tokenizer.json)")
    p.add_argument("--finetuned", required=True, help="full fine-tune of the base: HF directory, same architecture")
    p.add_argument("--out", required=True, help="delta directory to create (must be absent or empty)")
    p.add_argument("--bits", type=int, choices=(2, 4), default=4, help="bits per stored value (default 4)")
    p.add_argument("--sparsity", choices=("2:4", "none"), default="2:4", help="2:4 structured sparsity or none")
    p.add_argument("--group-size", type=int, default=64, help="input columns per quantization scale (default 64)")
    p.add_argument("--calib", default=None, help='calibration JSONL ({"text": ...} or {"input_ids": [...]} per line)')
    p.add_argument("--lossless", action="store_true", help="losslessly compress the payload (zstd, else lzma)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    p.add_argument("--nsamples", type=int, default=128, help="most calibration sequences (default 128)")
    p.add_argument("--seqlen", type=int, default=512, help="longest calibration sequence in tokens (default 512)")
    p.add_argument(
        "--full-weights",
        action="store_true",
        help="compress the fine-tuned weights themselves, not the delta (SparseGPT baseline, for comparison)",
    )
    p.add_argument("--quiet", action="store_true", help="no per-layer progress and no per-tensor table")
    return p


def help_text() -> str:
    """``deltaserve compress --help``'s text."""
    return build_parser().format_help()


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv == ["--write-help"]:
        HELP_FILE.write_text(help_text())
        print(f"wrote {HELP_FILE}")
        return 0
    args = build_parser().parse_args(argv)
    from .compressor import CompressConfig, compress, format_report  # torch only after arguments parse

    config = CompressConfig(
        bits=args.bits,
        sparse=args.sparsity == "2:4",
        group_size=args.group_size,
        calib=args.calib,
        nsamples=args.nsamples,
        seqlen=args.seqlen,
        device=args.device,
        lossless=args.lossless,
        full_weights=args.full_weights,
    )
    try:
        manifest = compress(args.base, args.finetuned, args.out, config, progress=None if args.quiet else sys.stderr)
    except ValueError as e:
        print(f"deltaserve compress: {e}", file=sys.stderr)
        return 2
    print(format_report(manifest, per_tensor=not args.quiet))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
