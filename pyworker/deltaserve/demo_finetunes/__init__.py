"""Full fine-tunes of the demo model (SmolLM2-135M-Instruct): the variants that ΔCompress compresses.

Each fine-tune trains every weight of the demo model on one task of ``deltaserve.demo_adapters``
(same prompts, exact answers, held-out split, chat-template rendering and training loop: this
module imports them, it owns only the recipe and the saved directory):

- ``json``   "Give the word as JSON: apple" -> ``{"word": "apple"}``
- ``shout``  "Give the word in upper case inside brackets: apple" -> ``[APPLE]``

The base model does neither (0% on the held-out words). The learning rate is small (``RECIPES``)
so that ``W_ft − W_base`` stays small, which is what delta compression assumes; full fine-tuning
learns these tasks in fewer steps than the LoRA adapters need.

Saved as a plain HF directory (too big to commit), by default
``$DELTASERVE_HOME/finetunes/<task>/`` (``~/.cache/deltaserve/finetunes/<task>/``)::

    model.safetensors        float32, every weight (lm_head tied to embed_tokens, as in the base)
    config.json              written by transformers (same architecture fields as the base)
    tokenizer.json, tokenizer_config.json, chat_template.jinja, generation_config.json
                             copied byte for byte from the base directory
    deltaserve-finetune.json recipe, seconds, held-out accuracy (transformers, greedy)

float32 and not bfloat16: at these learning rates most per-weight changes are below bfloat16's
resolution at the weight's magnitude, so rounding would erase much of the fine-tune.

CLI::

    python -m deltaserve.demo_finetunes --train [--out DIR] [--task NAME ...] [--steps N] [--lr LR]
    python -m deltaserve.demo_finetunes --eval  [--out DIR] [--task NAME ...]

``bench/eval_quality.py`` compresses these fine-tunes and measures them through the daemon.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from deltaserve.demo_adapters import SEED, accuracy, examples, fit, load_base


@dataclass(frozen=True)
class Recipe:
    """How one full fine-tune is trained (the task itself is ``demo_adapters.TASKS[task]``)."""

    #: Task name (a key of ``demo_adapters.TASKS``) and directory name.
    task: str
    #: Optimizer steps (batches of 8).
    steps: int
    #: Peak AdamW learning rate; small so the delta stays small.
    lr: float


RECIPES: dict[str, Recipe] = {
    "json": Recipe("json", steps=40, lr=2e-5),
    "shout": Recipe("shout", steps=80, lr=2e-5),
}

#: Files copied from the base directory into each fine-tune (tokenizer, chat template, generation).
COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                "generation_config.json")  # fmt: skip
#: Marker file of a fine-tune directory: recipe, training seconds, held-out accuracy.
MARKER = "deltaserve-finetune.json"


def default_root() -> Path:
    """``$DELTASERVE_HOME/finetunes`` (``~/.cache/deltaserve/finetunes``)."""
    from deltaserve.demo_model import deltaserve_home

    return deltaserve_home() / "finetunes"


def train_finetune(recipe: Recipe, model_dir: Path, out_dir: Path) -> float:
    """Trains every weight of the demo model on ``recipe.task`` and saves it as an HF directory in
    ``out_dir`` (written into a temporary sibling, then renamed into place); returns seconds spent."""
    import torch

    torch.manual_seed(SEED)
    tok, model = load_base(model_dir)
    params = [p for p in model.parameters() if p.requires_grad]
    secs = fit(model, tok, recipe.task, params, recipe.steps, recipe.lr)
    model.eval()
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, safe_serialization=True)
    for fname in COPIED_FILES:
        if (model_dir / fname).is_file():
            shutil.copyfile(model_dir / fname, tmp / fname)
    (tmp / MARKER).write_text(
        json.dumps({"recipe": asdict(recipe), "train_seconds": round(secs, 1), "base": str(model_dir)}, indent=2) + "\n"
    )
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    return secs


def check_loadable(out_dir: Path, model_dir: Path) -> None:
    """The fine-tune must fit the base: same structural config and tensor shapes (``DeltaLineageError``
    otherwise), which is what ``deltaserve compress`` checks before it starts."""
    from deltaserve.compress.delta_dir import checkpoint_shapes, compare_signatures, model_signature
    from deltaserve.model.arch import ModelConfig

    compare_signatures(
        model_signature(ModelConfig.from_model_dir(model_dir)),
        model_signature(ModelConfig.from_model_dir(out_dir)),
        f"base {model_dir}",
        f"fine-tune {out_dir}",
    )
    base = {k: v[1] for k, v in checkpoint_shapes(model_dir).items()}
    for name, (_, shape) in checkpoint_shapes(out_dir).items():
        if base.get(name) != shape:
            raise ValueError(
                f"fine-tune {out_dir}: tensor '{name}' has shape {list(shape)}, the base "
                f"{model_dir} has {base.get(name)}"
            )


def evaluate(root: Path, model_dir: Path, tasks: list[str]) -> dict[str, dict[str, float]]:
    """Held-out accuracy (transformers, greedy) of the base and of each fine-tune in ``root/<task>``;
    also recorded in the fine-tune's marker file."""
    from transformers import AutoModelForCausalLM

    res = {}
    tok, base = load_base(model_dir)
    for name in tasks:
        pairs = examples(name, "heldout")
        base_acc = accuracy(base, tok, pairs)
        ft = AutoModelForCausalLM.from_pretrained(root / name)
        ft_acc = accuracy(ft, tok, pairs)
        res[name] = {"base": base_acc, "finetune": ft_acc}
        marker = root / name / MARKER
        meta = json.loads(marker.read_text()) if marker.is_file() else {}
        meta["heldout_accuracy"] = {"words": len(pairs), **res[name]}
        marker.write_text(json.dumps(meta, indent=2) + "\n")
        print(
            f"[{name}] held-out ({len(pairs)} words): base {base_acc:.0%}, fine-tune {ft_acc:.0%}",
            file=sys.stderr,
            flush=True,
        )
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m deltaserve.demo_finetunes", description=__doc__.split("\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--train", action="store_true", help="train (every weight), save, check and evaluate")
    mode.add_argument("--eval", action="store_true", help="only evaluate the fine-tunes already in --out")
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help="root directory; fine-tunes go to OUT/<task>/ (default: $DELTASERVE_HOME/finetunes)",
    )
    ap.add_argument("--task", action="append", choices=sorted(RECIPES), help="default: all tasks")
    ap.add_argument("--steps", type=int, default=None, help="override the recipe's optimizer steps")
    ap.add_argument("--lr", type=float, default=None, help="override the recipe's learning rate")
    ap.add_argument("--no-eval", action="store_true", help="with --train: skip the held-out evaluation")
    ap.add_argument("--model", type=Path, help="demo model directory (default: deltaserve.demo_model's)")
    args = ap.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        ap.error(f"--steps must be >= 1, got {args.steps}")
    if args.lr is not None and not args.lr > 0:
        ap.error(f"--lr must be > 0, got {args.lr}")

    import torch

    torch.set_num_threads(2)
    if args.model is not None:
        model_dir = args.model
    else:
        from deltaserve.demo_model import default_out_dir

        model_dir = default_out_dir()
    if not (model_dir / "config.json").is_file():
        ap.error(f"{model_dir} holds no demo model: run `python -m deltaserve.demo_model` first")
    root = args.out if args.out is not None else default_root()
    tasks = args.task or sorted(RECIPES)
    if args.train:
        for name in tasks:
            r = RECIPES[name]
            r = Recipe(r.task, args.steps or r.steps, args.lr or r.lr)
            secs = train_finetune(r, model_dir, root / name)
            check_loadable(root / name, model_dir)
            print(
                f"[{name}] fully fine-tuned in {secs:.0f} s ({r.steps} steps, lr {r.lr:g}) -> {root / name}",
                file=sys.stderr,
                flush=True,
            )
        if args.no_eval:
            return 0
    else:
        missing = [n for n in tasks if not (root / n / "config.json").is_file()]
        if missing:
            ap.error(f"no fine-tune in {root} for {', '.join(missing)}: run with --train first")
    print(json.dumps(evaluate(root, model_dir, tasks)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
