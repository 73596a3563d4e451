"""The demo LoRA adapters of the demo model (SmolLM2-135M-Instruct): their tasks, data and training.

Owns the two committed adapters next to this file and the script that made them:

- ``shout/``  "Give the word in upper case inside brackets: apple" -> ``[APPLE]``. LoRA r=8, alpha=16,
              on all seven projections.
- ``json/``   "Give the word as JSON: apple" -> ``{"word": "apple"}``. LoRA r=4, alpha=8, on ``q_proj``
              and ``v_proj`` only.

Both are tasks the base model does not do (it answers with a sentence), with one exact answer each,
so accuracy is an exact match after stripping whitespace. Words come from the built-in ``WORDS`` list, split by a fixed seed into disjoint train and held-out sets
(``split_words``); ``examples(task, "heldout")`` gives the held-out (prompt, answer) pairs the e2e
test sends through the daemon.

Training is CPU-only, ``peft`` + AdamW, on the exact text the daemon serves: the chat template of
the demo model's tokenizer renders the user message (with the template's default system prompt and
the assistant generation prompt); the answer tokens and ``<|im_end|>`` follow, and only they carry
loss. The adapters are saved in bfloat16 with ``save_pretrained(safe_serialization=True)`` and
checked with ``deltaserve.adapters.load_lora_adapter``.

Measured (``--train``, 2 CPU threads; held-out words, greedy, transformers + peft on the saved
bf16 adapters over the fp32 base):

    task    LoRA                 train   steps  file (bf16)    base   adapter
    json    r=4, q_proj v_proj   160 s   100    476,344 B       0%    98% (78/80)
    shout   r=8, all seven       411 s   200    4,939,072 B     0%    68% (54/80)

    (2026-11 run: torch 2.13 CPU, peft 0.21.2, transformers 5.x; 10 min 10 s in all, evaluation
    included.) Through the daemon (tests/e2e/test_demo_adapters.py, the first 20 held-out words,
    bf16 base): json 100%, shout 85%, base 0% on both. shout's misses are near-spellings of the
    upper-case pieces ("[CLIMB]" for cloud): the 135M base knows upper-case spellings imperfectly.
    A first try at "Reverse the word" (r=8, all seven) was dropped: its loss stayed near 3.2 per
    token after 76 steps, so it would not generalise in CPU minutes.

CLI::

    python -m deltaserve.demo_adapters --train [--out DIR] [--task NAME ...]
    python -m deltaserve.demo_adapters --eval [--out DIR]     # accuracy of the adapters in DIR

``--out`` defaults to this package directory (where the committed adapters live).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

#: Where the committed adapters live (``<here>/<task>/``).
HERE = Path(__file__).resolve().parent
#: Seed for the word split, the LoRA initialisation and the batch order.
SEED = 1234
#: Words kept out of training; the rest train.
HELDOUT_SIZE = 80

#: Common English words, lower case, 3 to 8 letters, no duplicates.
WORDS = """
apple table water house chair green river music paper light stone bread dream cloud plant night
sugar horse phone smile heart money voice world story power train beach field glass honey lemon
tiger zebra piano radio salad queen king party quick brown fox jumps lazy dog happy sunny rain snow
wind fire earth metal wood silver gold copper iron spring summer autumn winter morning evening
garden flower forest desert island ocean valley mountain city town village road bridge tower castle
window door floor wall roof kitchen bottle cup plate spoon fork knife butter cheese milk coffee tea
juice orange banana grape cherry peach melon carrot potato tomato onion garlic pepper salt rice
pasta pizza cookie candy cake bird fish mouse rabbit snake eagle shark whale camel monkey panda
lion bear wolf deer duck goose frog turtle spider bee ant butterfly doctor nurse teacher student
farmer driver pilot artist writer singer dancer player captain soldier police friend family mother
father sister brother uncle aunt cousin baby child woman man people person school market office
hotel church museum library station airport hospital bank shop store street corner square park
circle number letter word book page pencil pen desk lamp clock watch ring shirt dress shoe hat coat
jacket sock glove scarf bag box basket blanket pillow bed sofa mirror picture camera computer
keyboard screen printer engine wheel car truck bus bicycle boat ship plane rocket planet star moon
sun sky storm thunder river lake pond hill rock sand dust smoke ice steam wave shadow color black
white yellow purple pink gray silver blue red small large short long happy angry calm brave clever
gentle kind proud quiet simple strong sweet warm cold fresh clean dirty empty full heavy light
early late fast slow open close begin finish build break carry catch climb cook dance draw drink
drive eat fall fight find fly forget give grow hear help hold hunt jump keep kick learn leave listen
live look make meet move pay play pull push read ride run say see sell send sing sit sleep speak
stand start stop swim take talk teach tell think throw touch travel walk want wash watch wear win
work write answer basic danger effort energy future health idea island justice language machine
memory method nature object option pattern reason result season secret silence signal system theory
travel value wonder animal bottle candle carpet dinner finger hammer helmet jungle ladder magnet
needle orbit pocket puzzle rhythm saddle ticket tunnel violin wallet yogurt zipper anchor button
cactus donkey eleven falcon giraffe harbor insect jacket kettle lizard marble nephew oyster parrot
rescue saucer thumb umbrella velvet walnut yellow zenith
"""


def word_list() -> list[str]:
    """``WORDS`` as a list, in order, duplicates removed."""
    seen: dict[str, None] = {}
    for w in WORDS.split():
        if not (w.isalpha() and w.islower()):
            raise ValueError(f"WORDS holds {w!r}: only lower-case letters are allowed")
        seen.setdefault(w, None)
    return list(seen)


def split_words(seed: int = SEED, heldout: int = HELDOUT_SIZE) -> tuple[list[str], list[str]]:
    """(train, heldout): a seeded shuffle of the word list, the last ``heldout`` words held out."""
    words = word_list()
    random.Random(seed).shuffle(words)
    return words[:-heldout], words[-heldout:]


@dataclass(frozen=True)
class Task:
    """One demo adapter: what it is asked, what it must answer, and how its LoRA is shaped."""

    #: Adapter name (directory name and ``--lora NAME=...``).
    name: str
    #: User message with ``{word}`` in it.
    template: str
    #: LoRA rank.
    r: int
    #: LoRA alpha (scaling = alpha / r).
    alpha: int
    #: Projections the LoRA targets.
    targets: tuple[str, ...]
    #: Optimizer steps.
    steps: int
    #: AdamW learning rate.
    lr: float

    def prompt(self, word: str) -> str:
        return self.template.format(word=word)

    def answer(self, word: str) -> str:
        if self.name == "json":
            return json.dumps({"word": word})
        if self.name == "shout":
            return f"[{word.upper()}]"
        raise ValueError(f"no answer rule for task {self.name!r}")


SEVEN = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

TASKS: dict[str, Task] = {
    "shout": Task(
        "shout", "Give the word in upper case inside brackets: {word}", r=8, alpha=16, targets=SEVEN, steps=200, lr=2e-3
    ),
    "json": Task(
        "json", "Give the word as JSON: {word}", r=4, alpha=8, targets=("q_proj", "v_proj"), steps=100, lr=2e-3
    ),
}


def examples(task: str, split: str) -> list[tuple[str, str]]:
    """(user message, exact answer) for every word of ``split`` ("train" or "heldout")."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; known: {sorted(TASKS)}")
    train, held = split_words()
    words = {"train": train, "heldout": held}.get(split)
    if words is None:
        raise ValueError(f"split must be 'train' or 'heldout', not {split!r}")
    t = TASKS[task]
    return [(t.prompt(w), t.answer(w)) for w in words]


def render_prompt(tokenizer, message: str) -> str:
    """The chat-templated prompt the daemon renders for one user message (generation prompt on)."""
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": message}], tokenize=False, add_generation_prompt=True
    )


def encode(tokenizer, message: str, answer: str) -> tuple[list[int], list[int]]:
    """(input ids, labels): prompt ids masked with -100, then answer + <|im_end|> as targets."""
    p = tokenizer(render_prompt(tokenizer, message), add_special_tokens=False)["input_ids"]
    a = tokenizer(answer + "<|im_end|>", add_special_tokens=False)["input_ids"]
    return p + a, [-100] * len(p) + a


def load_base(model_dir: Path):
    """(tokenizer, float32 ``AutoModelForCausalLM``) of the demo model directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return tok, model


def fit(model, tok, task: str, params, steps: int, lr: float) -> float:
    """Trains ``params`` of ``model`` on ``task``'s training examples; returns seconds spent.

    AdamW (no weight decay), batches of 8 in a seeded shuffled order, a 20-step linear warmup then
    linear decay to 5% of ``lr``; loss only on the answer tokens (``encode``). Shared by the LoRA
    adapters here and the full fine-tunes of ``deltaserve.demo_finetunes``.
    """
    import torch

    data = [encode(tok, m, a) for m, a in examples(task, "train")]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * max(0.05, 1 - s / steps))
    rng = random.Random(SEED)
    batch, pad = 8, tok.pad_token_id if tok.pad_token_id is not None else 0
    order: list[int] = []
    t0 = time.monotonic()
    model.train()
    for step in range(steps):
        if len(order) < batch:
            more = list(range(len(data)))
            rng.shuffle(more)
            order += more
        idx, order = order[:batch], order[batch:]
        n = max(len(data[i][0]) for i in idx)
        ids = torch.tensor([data[i][0] + [pad] * (n - len(data[i][0])) for i in idx])
        labels = torch.tensor([data[i][1] + [-100] * (n - len(data[i][1])) for i in idx])
        mask = torch.tensor([[1] * len(data[i][0]) + [0] * (n - len(data[i][0])) for i in idx])
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 25 == 0 or step == steps - 1:
            print(
                f"[{task}] step {step + 1}/{steps} loss {loss.item():.4f} ({time.monotonic() - t0:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
    return time.monotonic() - t0


def train_task(task: Task, model_dir: Path, out_dir: Path) -> float:
    """Trains one adapter and saves it (bf16) into ``out_dir``; returns seconds spent."""
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(SEED)
    tok, base = load_base(model_dir)
    model = get_peft_model(
        base,
        LoraConfig(
            r=task.r, lora_alpha=task.alpha, target_modules=list(task.targets), lora_dropout=0.0, task_type="CAUSAL_LM"
        ),
    )
    t0 = time.monotonic()
    fit(model, tok, task.name, [p for p in model.parameters() if p.requires_grad], task.steps, task.lr)
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.data = p.data.to(torch.bfloat16)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    cfg_path = out_dir / "adapter_config.json"  # drop the machine-local base path peft records
    cfg = json.loads(cfg_path.read_text())
    cfg["base_model_name_or_path"] = "SmolLM2-135M-Instruct"
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    readme = out_dir / "README.md"
    if readme.exists():
        readme.unlink()
    return time.monotonic() - t0


def check_loadable(out_dir: Path, model_dir: Path) -> None:
    """Our own loader must accept the adapter (raises ``LoraAdapterError`` otherwise)."""
    from deltaserve.adapters import load_lora_adapter
    from deltaserve.model.arch import ModelConfig

    load_lora_adapter(out_dir, ModelConfig.from_model_dir(model_dir))


def accuracy(model, tok, pairs: list[tuple[str, str]], max_new_tokens: int = 16) -> float:
    """Exact-match rate (after stripping whitespace) of greedy answers, batched with left padding."""
    import torch

    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    hits = 0
    model.eval()
    for i in range(0, len(pairs), 40):
        chunk = pairs[i : i + 40]
        enc = tok(
            [render_prompt(tok, m) for m, _ in chunk], return_tensors="pt", padding=True, add_special_tokens=False
        )
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
        for row, (_, want) in zip(out[:, enc["input_ids"].shape[1] :], chunk):
            got = tok.decode(row, skip_special_tokens=True).strip()
            hits += got == want
    return hits / len(pairs)


def evaluate(out_root: Path, model_dir: Path, tasks: list[str]) -> dict[str, dict[str, float]]:
    """Held-out accuracy of the base and of each adapter in ``out_root/<task>``."""
    from peft import PeftModel

    res = {}
    for name in tasks:
        pairs = examples(name, "heldout")
        tok, base = load_base(model_dir)
        base_acc = accuracy(base, tok, pairs)
        model = PeftModel.from_pretrained(base, out_root / name)
        res[name] = {"base": base_acc, "adapter": accuracy(model, tok, pairs)}
        print(
            f"[{name}] held-out ({len(pairs)} words): base {base_acc:.0%}, adapter {res[name]['adapter']:.0%}",
            file=sys.stderr,
            flush=True,
        )
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m deltaserve.demo_adapters", description=__doc__.split("\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--train", action="store_true", help="train, save, validate and evaluate")
    mode.add_argument("--eval", action="store_true", help="only evaluate the adapters already in --out")
    ap.add_argument("--out", type=Path, default=HERE, help="root directory; adapters go to OUT/<task>/")
    ap.add_argument("--task", action="append", choices=sorted(TASKS), help="default: all tasks")
    ap.add_argument("--model", type=Path, help="demo model directory (default: deltaserve.demo_model's)")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(2)
    if args.model is not None:
        model_dir = args.model
    else:
        from deltaserve.demo_model import default_out_dir

        model_dir = default_out_dir()
    if not (model_dir / "config.json").is_file():
        ap.error(f"{model_dir} holds no demo model: run `python -m deltaserve.demo_model` first")
    tasks = args.task or sorted(TASKS)
    if args.train:
        for name in tasks:
            secs = train_task(TASKS[name], model_dir, args.out / name)
            check_loadable(args.out / name, model_dir)
            size = (args.out / name / "adapter_model.safetensors").stat().st_size
            print(f"[{name}] trained in {secs:.0f} s; adapter_model.safetensors {size} bytes", file=sys.stderr)
    print(json.dumps(evaluate(args.out, model_dir, tasks)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
