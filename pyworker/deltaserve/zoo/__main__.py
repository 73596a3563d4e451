"""``python -m deltaserve.zoo add|ls|rm``: the block zoo's command line.

    python -m deltaserve.zoo add --zoo DIR --base BASE_DIR --name NAME --finetuned FT_DIR
        [--threshold 0.98] [--calib FILE] [--share-equivalent] [--share-from-layer L] [--dense]
        [--bits 2|4] [--sparsity 2:4|none] [--group-size 64] [--nsamples N] [--seqlen L]
        [--substitute-min-similarity X]
    python -m deltaserve.zoo ls --zoo DIR
    python -m deltaserve.zoo rm --zoo DIR --name NAME

Exit codes: 0 done, 2 bad arguments or inputs (the message names the variant, file and field;
nothing changes).
"""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="deltaserve zoo", description="The block zoo (BlockLLM): add, list, remove variants."
    )
    sub = p.add_subparsers(dest="command", required=True)
    add = sub.add_parser("add", help="add a fine-tune as a chain of base runs and own blocks")
    add.add_argument("--zoo", required=True, help="zoo directory (created if absent)")
    add.add_argument("--base", required=True, help="the base model: HF directory (the zoo's base)")
    add.add_argument("--name", required=True, help="variant name (served as <base>:NAME)")
    add.add_argument("--finetuned", required=True, help="the fine-tune: HF directory, same architecture")
    add.add_argument("--threshold", type=float, default=0.98, help="logit-lens similarity for equivalence (0.98)")
    add.add_argument("--calib", default=None, help='calibration JSONL ({"text": ...} or {"input_ids": [...]})')
    add.add_argument("--share-equivalent", action="store_true",
                     help="serve equivalent blocks with the base's (changes the model; off by default)")  # fmt: skip
    add.add_argument("--share-from-layer", type=int, default=None,
                     help="first layer whose blocks may be shared (default max(1, layers/4))")  # fmt: skip
    add.add_argument("--dense", action="store_true", help="store own blocks dense instead of as ΔCompress deltas")
    add.add_argument("--bits", type=int, choices=(2, 4), default=4, help="ΔCompress bits (4)")
    add.add_argument("--sparsity", choices=("2:4", "none"), default="2:4", help="ΔCompress sparsity (2:4)")
    add.add_argument("--group-size", type=int, default=64, help="ΔCompress quantization group (64)")
    add.add_argument("--nsamples", type=int, default=32, help="calibration sequences (32)")
    add.add_argument("--seqlen", type=int, default=256, help="longest calibration sequence (256)")
    add.add_argument("--substitute-min-similarity", type=float, default=None,
                     help="opt in to substitution under load: own blocks at least this similar to the base's "
                     "run as the base's while `deltaserve --substitute-above` says the server is loaded")  # fmt: skip
    add.add_argument("--quiet", action="store_true", help="no progress on stderr")
    ls = sub.add_parser("ls", help="variants, chains, sharing and bytes saved")
    ls.add_argument("--zoo", required=True)
    rm = sub.add_parser("rm", help="remove a variant and the blocks no chain uses")
    rm.add_argument("--zoo", required=True)
    rm.add_argument("--name", required=True)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    from . import AddOptions, add_variant, describe, remove_variant  # torch only after arguments parse

    try:
        if args.command == "add":
            options = AddOptions(
                threshold=args.threshold, share_equivalent=args.share_equivalent,
                share_from_layer=args.share_from_layer, dense=args.dense, calib=args.calib, bits=args.bits,
                sparse=args.sparsity == "2:4", group_size=args.group_size, nsamples=args.nsamples, seqlen=args.seqlen,
                substitute_min_similarity=args.substitute_min_similarity,
            )  # fmt: skip
            add_variant(args.zoo, args.base, args.name, args.finetuned, options, None if args.quiet else sys.stderr)
            print(describe(args.zoo))
        elif args.command == "ls":
            print(describe(args.zoo))
        else:
            gone = remove_variant(args.zoo, args.name)
            print(f"removed {args.name}; blocks collected: {', '.join(gone) or 'none'}")
    except (ValueError, OSError) as e:
        print(f"deltaserve zoo {args.command}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
