"""Task quality of block-zoo sharing (issue 23, BlockLLM's accuracy question), on the CPU: a partial
and a full fine-tune of the demo model (SmolLM2-135M-Instruct) on a demo task, each added to a zoo
with exact sharing only and with equivalence sharing at logit-lens thresholds 0.99 / 0.98 / 0.95
(``zoo add --share-equivalent --threshold T``), next to the bytes each keeps.

    python -m bench.zoo_quality [--task json] [--heldout 40] [--work DIR]

The fine-tunes (trained once, reused from ``--work`` / the demo fine-tunes' directory)::

    full      ``python -m deltaserve.demo_finetunes --train``: every weight (the demo's recipe)
    partial   the same loop (``demo_adapters.fit``) training only the last half of the layers
              (the embedding, the first half and the final norm frozen), ``PARTIAL_LR``

Own blocks are stored dense (``--dense``), so exact sharing holds exactly the fine-tune (asserted:
its accuracy is the fine-tune's) and every difference comes from sharing equivalent blocks. Each
variant is evaluated on what its blocks hold (``materialize`` of a partial delta would need delta
storage, so the chain is assembled directly: the fine-tune's tensors where the chain has an own
block, the base's elsewhere), greedy, exact match on held-out words (``demo_adapters.accuracy``),
in transformers; serving reproduces those tokens exactly (tests/zoo/test_serving.py).

The logit lens runs on ``--nsamples`` x ``--seqlen`` tokens of the task's training text (small by
default), once per fine-tune: its four adds share it (``lens_once``). Writes ``bench/results/zoo_quality-cpu-<date>.json``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.common import write_result
from bench.eval_quality import write_calibration
from bench.launch import demo_model_dir

THRESHOLDS = (0.99, 0.98, 0.95)
PARTIAL_LR = 5e-5
"""The partial fine-tune trains half the weights: a larger step than the full recipe's 2e-5."""


def train_partial(task: str, base: Path, out: Path, steps: int) -> float:
    """Trains the last half of the layers of the demo model on ``task``; saved like a demo fine-tune."""
    import torch

    from deltaserve.demo_adapters import fit, load_base
    from deltaserve.demo_finetunes import COPIED_FILES, SEED

    torch.manual_seed(SEED)
    tok, model = load_base(base)
    layers = model.model.layers
    keep = {id(p) for layer in layers[len(layers) // 2 :] for p in layer.parameters()}
    for p in model.parameters():
        p.requires_grad_(id(p) in keep)
    secs = fit(model, tok, task, [p for p in model.parameters() if p.requires_grad], steps, PARTIAL_LR)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    # In the base's dtype, as its checkpoint: the frozen tensors then equal the base's byte for byte, so
    # `zoo add` finds their blocks identical (its content hash covers the dtype: saved in float32 from a
    # bfloat16 base, every block differs and none is shared as identical).
    from deltaserve.zoo.blocks import Checkpoint

    stored = Checkpoint(base).get("model.embed_tokens.weight").dtype  # the config may not name it
    model.to(stored).eval().save_pretrained(tmp, safe_serialization=True)
    for fname in COPIED_FILES:
        if (base / fname).is_file():
            shutil.copyfile(base / fname, tmp / fname)
    tmp.rename(out)
    return secs


def lens_once() -> None:
    """Every mode of one fine-tune runs the same logit lens (same base, fine-tune, calibration and
    components): ``zoo add``'s lens is wrapped so that it runs once per fine-tune in this process."""
    from deltaserve.zoo import add

    lens = add.lens_similarities
    done: dict[tuple[str, str, str], dict[str, float]] = {}

    def cached(base_dir, finetuned_dir, samples, wanted):  # type: ignore[no-untyped-def]
        key = (str(base_dir), str(finetuned_dir), ",".join(sorted(wanted)))  # one calibration per run
        if key not in done:
            done[key] = lens(base_dir, finetuned_dir, samples, wanted)
        return dict(done[key])

    add.lens_similarities = cached  # type: ignore[assignment]


def chain_model(base: Path, finetuned: Path, entry: dict[str, Any]):
    """The model a zoo variant's chain holds: the fine-tune with every component the chain gives to
    the base block (shared equivalent ones) set back to the base's tensors."""
    import torch
    from transformers import AutoModelForCausalLM

    from deltaserve.model.arch import ModelConfig
    from deltaserve.zoo.blocks import Checkpoint, tensor_names

    model = AutoModelForCausalLM.from_pretrained(finetuned, dtype=torch.float32).eval()
    names = tensor_names(ModelConfig.from_model_dir(base))
    ck = Checkpoint(base)
    state = model.state_dict()
    with torch.no_grad():
        for c in entry["shared_equivalent"]:
            for n in names[c]:
                state[n].copy_(ck.get(n).to(torch.float32))
    return model


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.zoo_quality", description=__doc__.split("\n")[0])
    ap.add_argument("--task", default="json")
    ap.add_argument("--heldout", type=int, default=40)
    ap.add_argument("--nsamples", type=int, default=4)
    ap.add_argument("--seqlen", type=int, default=48)
    ap.add_argument("--steps", type=int, default=40, help="optimizer steps of the partial fine-tune")
    ap.add_argument("--kinds", default="partial,full", help="which fine-tunes (partial, full)")
    ap.add_argument("--work", type=Path, default=None, help="default $DELTASERVE_HOME/zoo_quality")
    ap.add_argument("--out-dir", type=Path, default=None)
    args = ap.parse_args(argv)

    from deltaserve.demo_adapters import accuracy, examples, load_base
    from deltaserve.demo_finetunes import RECIPES, default_root, train_finetune
    from deltaserve.demo_model import deltaserve_home
    from deltaserve.zoo import AddOptions, add_variant
    from deltaserve.zoo.catalog import sizes
    from deltaserve.zoo.manifest import read_manifest

    base = demo_model_dir()
    work = args.work or deltaserve_home() / "zoo_quality"
    work.mkdir(parents=True, exist_ok=True)
    tok, _ = load_base(base)
    pairs = examples(args.task, "heldout")[: args.heldout]
    calib = work / f"calib-{args.task}.jsonl"
    write_calibration(args.task, base, calib)
    paths = {"full": default_root() / args.task, "partial": work / f"partial-{args.task}"}
    kinds = args.kinds.split(",")
    if not kinds or any(k not in paths for k in kinds):
        raise SystemExit(f"--kinds {args.kinds!r}: want some of partial, full")
    finetunes = {k: paths[k] for k in kinds}
    trained: dict[str, float | None] = {}
    if "full" in finetunes and not (finetunes["full"] / "config.json").is_file():
        trained["full"] = train_finetune(RECIPES[args.task], base, finetunes["full"])
    if "partial" in finetunes and not (finetunes["partial"] / "config.json").is_file():
        trained["partial"] = train_partial(args.task, base, finetunes["partial"], args.steps)
    opts = AddOptions(dense=True, calib=str(calib), nsamples=args.nsamples, seqlen=args.seqlen)
    lens_once()
    rows: dict[str, dict[str, Any]] = {}
    for kind, ft in finetunes.items():
        from transformers import AutoModelForCausalLM

        ft_acc = accuracy(AutoModelForCausalLM.from_pretrained(ft).eval(), tok, pairs)
        zoo = work / f"zoo-{args.task}-{kind}"
        shutil.rmtree(zoo, ignore_errors=True)
        modes = [("exact", opts)] + [(f"eq{t}", replace(opts, share_equivalent=True, threshold=t)) for t in THRESHOLDS]
        for mode, o in modes:
            t0 = time.monotonic()
            try:
                entry = add_variant(zoo, base, mode, ft, o, progress=None)
            except ValueError as e:  # e.g. every block equivalent: the variant would be the base model
                rows[f"{kind}/{mode}"] = {"error": str(e)}
                continue
            add_s = time.monotonic() - t0
            acc = accuracy(chain_model(base, ft, entry), tok, pairs)
            m = read_manifest(zoo)
            s = sizes(m)
            rows[f"{kind}/{mode}"] = {
                "accuracy": acc, "finetune_accuracy": ft_acc, "own_bytes": s.own_bytes[mode],
                "fp16_model_bytes": s.fp16_bytes[mode], "shared_equivalent": entry["shared_equivalent"],
                "own_components": sum(seg["block"] != "base" for seg in entry["chain"]), "add_seconds": round(add_s, 1),
                "min_similarity": min(entry["similarity"].values()),
            }  # fmt: skip
            if mode == "exact":
                assert acc == ft_acc, f"{kind}: exact sharing gave {acc}, the fine-tune {ft_acc}"
            print(f"{kind:8s} {mode:7s} accuracy {acc:.0%} (fine-tune {ft_acc:.0%}), own {s.own_bytes[mode] / 1e6:.1f} MB, "
                  f"{len(entry['shared_equivalent'])} blocks shared by equivalence", file=sys.stderr, flush=True)  # fmt: skip
        zoo_bytes = sizes(read_manifest(zoo)).stored_bytes
        rows[f"{kind}/zoo"] = {"stored_bytes_all_modes": zoo_bytes}
    result = {"device": "cpu", "task": args.task, "heldout": len(pairs), "nsamples": args.nsamples,
              "seqlen": args.seqlen, "partial_lr": PARTIAL_LR, "partial_steps": args.steps, "trained_seconds": trained,
              "storage": "dense", "rows": rows}  # fmt: skip
    name = "zoo_quality" if len(kinds) == 2 else f"zoo_quality-{kinds[0]}"
    print(f"result: {write_result(name, result, args.out_dir)}")


if __name__ == "__main__":
    main()
