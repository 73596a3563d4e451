"""The calibration set of ΔCompress: texts (or token ids) -> token sequences of the base's tokenizer.

Input: a JSONL file, one object per line, ``{"text": "..."}`` or ``{"input_ids": [1, 2, ...]}``
(pre-tokenized; ids must be < the vocabulary size); blank lines are skipped. Without a file the
built-in ``DEFAULT_TEXTS`` are used: a few dozen short, varied texts (prose, dialogue, instructions,
code, numbers, lists) so every layer sees a spread of activations. DeltaZip calibrates on 256
samples of an instruction set or the fine-tune's own training data (§4.2): pass that as ``--calib``
whenever you have it; the built-in set is a fallback.

``calibration_samples`` tokenizes each text with the base directory's ``tokenizer.json``
(``tokenizers``), prepends the config's BOS id when the tokenizer does not add it, splits texts
longer than ``seqlen`` into consecutive windows and keeps the first ``nsamples`` sequences of at
least 2 tokens, in file order (deterministic).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DEFAULT_TEXTS: tuple[str, ...] = (
    "The history of the printing press begins in the fifteenth century, when movable metal type made "
    "books cheaper to produce. Within fifty years presses were running in more than two hundred European "
    "cities, and the number of books in circulation grew from thousands to millions.",
    "User: Can you recommend a good way to learn a new language?\nAssistant: Practice a little every day. "
    "Start with the most common words, listen to native speakers, and try to hold short conversations "
    "as early as possible, even if you make mistakes.",
    "def fibonacci(n: int) -> list[int]:\n    seq = [0, 1]\n    while len(seq) < n:\n        seq.append(seq[-1] "
    "+ seq[-2])\n    return seq[:n]\n\nprint(fibonacci(10))",
    "To make a simple tomato sauce, warm olive oil in a pan, add chopped garlic and cook until fragrant. "
    "Add crushed tomatoes, a pinch of salt and a few basil leaves, then simmer for twenty minutes.",
    "Question: A train travels 120 kilometres in 1.5 hours. What is its average speed?\nAnswer: The average "
    "speed is distance divided by time, so 120 / 1.5 = 80 kilometres per hour.",
    "Photosynthesis converts light energy into chemical energy. Plants absorb carbon dioxide and water and, "
    "using sunlight, produce glucose and release oxygen as a by-product.",
    "Dear team,\nThank you all for your hard work this quarter. We shipped three major releases and cut "
    "our response time in half. Please join us on Friday for a small celebration.\nBest regards,\nMaria",
    "SELECT customer_id, COUNT(*) AS orders, SUM(total) AS revenue\nFROM orders\nWHERE created_at >= "
    "'2024-01-01'\nGROUP BY customer_id\nORDER BY revenue DESC\nLIMIT 10;",
    "Once upon a time, a curious fox found a lantern in the forest. Each night it carried the light a little "
    "further, until it reached a village where the children had never seen a fox that was not afraid.",
    "Instruction: Summarize the following paragraph in one sentence.\nInput: The city council voted to "
    "expand the bike lane network, citing safety data and rising numbers of cyclists.\nOutput: The council "
    "approved more bike lanes because of safety concerns and growing cycling.",
    "1. Preheat the oven to 180 degrees.\n2. Mix flour, sugar and eggs.\n3. Pour the batter into a tin.\n"
    "4. Bake for 35 minutes.\n5. Let it cool before slicing.",
    "The mitochondria is often called the powerhouse of the cell because it produces most of the cell's "
    "supply of adenosine triphosphate, the molecule cells use as a source of chemical energy.",
    "In 1969, the Apollo 11 mission landed the first humans on the Moon. Neil Armstrong and Buzz Aldrin "
    "spent about two and a half hours outside the lunar module, collecting samples and taking photographs.",
    'fn main() {\n    let words = vec!["alpha", "beta", "gamma"];\n    for (i, w) in words.iter().enumerate() '
    '{\n        println!("{}: {}", i, w.to_uppercase());\n    }\n}',
    "Translate to French: The weather is lovely today and we are going to the beach.\nLe temps est "
    "magnifique aujourd'hui et nous allons à la plage.",
    "The derivative of x squared is two x. The integral of two x with respect to x is x squared plus a "
    "constant. These two operations are inverse to each other by the fundamental theorem of calculus.",
    "Customer: My order arrived damaged. What should I do?\nAgent: I'm sorry to hear that. Please send a "
    "photo of the damaged item and your order number, and we will ship a replacement right away.",
    "Key facts about Jupiter: it is the largest planet in the solar system, a gas giant made mostly of "
    "hydrogen and helium, with at least ninety-five known moons and a storm called the Great Red Spot.",
    "<html>\n  <body>\n    <h1>Welcome</h1>\n    <p>This page lists our opening hours: Monday to Friday, "
    "9:00 to 17:00.</p>\n  </body>\n</html>",
    "A good password is long, unique for every site, and stored in a password manager. Enable two-factor "
    "authentication wherever it is offered, and be wary of links in unexpected emails.",
    "The quarterly report shows revenue of 4.2 million dollars, up 12 percent year over year, while "
    "operating costs rose 5 percent. Net margin improved from 8.1 to 10.4 percent.",
    "Write a haiku about autumn.\nCrisp leaves drift and fall,\ngolden light on quiet paths,\nthe year "
    "breathes slower.",
    "import numpy as np\n\nx = np.linspace(0, 1, 100)\ny = np.sin(2 * np.pi * x)\nprint(y.mean(), y.std())",
    "The French Revolution began in 1789 and transformed the political landscape of Europe. It abolished "
    "feudal privileges, proclaimed the rights of man, and ended with the rise of Napoleon Bonaparte.",
    "Q: Is a tomato a fruit or a vegetable?\nA: Botanically it is a fruit, because it develops from the "
    "flower and contains seeds, but in cooking it is usually treated as a vegetable.",
    "Meeting notes, Tuesday: agreed to move the launch to March; Priya will update the roadmap; open "
    "question about pricing tiers; next meeting in two weeks.",
    "Water boils at 100 degrees Celsius at sea level. At higher altitudes the air pressure is lower, so "
    "water boils at a lower temperature and food takes longer to cook.",
    "Sorting algorithms compared: bubble sort is O(n^2), merge sort is O(n log n) and stable, quicksort is "
    "O(n log n) on average but O(n^2) in the worst case, and heapsort sorts in place in O(n log n).",
    "The old lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, "
    "polished the lens, and watched the beam sweep across the dark water until morning.",
    "Explain like I'm five: why is the sky blue?\nSunlight has all the colours mixed together. When it "
    "hits the air, the blue part bounces around the most, so blue light comes at us from every direction.",
    '{"name": "Ada", "age": 36, "skills": ["math", "programming"], "active": true}',
    "Exercise improves mood, sleep and heart health. Adults are advised to get at least 150 minutes of "
    "moderate activity per week, such as brisk walking or cycling, plus strength training twice a week.",
    "The capital of Japan is Tokyo, the capital of Canada is Ottawa, the capital of Australia is Canberra, "
    "and the capital of Brazil is Brasília.",
    'git checkout -b feature/login\ngit add src/login.py\ngit commit -m "Add login form validation"\n'
    "git push origin feature/login",
    "Assistant: Here is a short plan for your trip. Day one: visit the old town and the museum. Day two: "
    "take the train to the coast. Day three: hike the cliff path and return in the evening.",
    "Prime numbers below fifty: 2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47. There are fifteen "
    "of them, and every other whole number above one is a product of primes.",
    "The committee reviewed twelve proposals and selected three for funding. Each project will receive a "
    "grant for two years, with a progress review after the first twelve months.",
    "She opened the letter slowly. It was from her grandmother, written in careful blue ink, and it began: "
    "'By the time you read this, the garden will be full of the roses we planted together.'",
    "Rules of the game: each player draws five cards; on your turn, play a card of the same colour or number "
    "as the top card of the pile, or draw one; the first player with no cards left wins.",
    "Neural networks learn by adjusting their weights to reduce a loss function. Gradients are computed "
    "with backpropagation, and an optimizer such as Adam updates the weights in small steps.",
)
"""Built-in calibration texts (used when no ``--calib`` file is given)."""


class CalibrationError(ValueError):
    """A calibration file or sample that cannot be used; the message names the file and line."""


def load_calibration(path: str | Path | None) -> list[str | list[int]]:
    """The calibration items of a JSONL file (texts or token-id lists), or ``DEFAULT_TEXTS`` for None."""
    if path is None:
        return list(DEFAULT_TEXTS)
    path = Path(path)
    if not path.is_file():
        raise CalibrationError(f"calibration file {path} does not exist")
    items: list[str | list[int]] = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj: Any = json.loads(line)
        except json.JSONDecodeError as e:
            raise CalibrationError(f"{where}: not valid JSON: {e}") from e
        if isinstance(obj, dict) and isinstance(obj.get("text"), str):
            items.append(obj["text"])
        elif isinstance(obj, dict) and isinstance(obj.get("input_ids"), list):
            ids = obj["input_ids"]
            if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
                raise CalibrationError(f"{where}: 'input_ids' must be a list of non-negative integers")
            items.append(list(ids))
        else:
            raise CalibrationError(f"{where}: expected an object with a string 'text' or a list 'input_ids'")
    if not items:
        raise CalibrationError(f"calibration file {path} has no samples")
    return items


def calibration_samples(
    items: list[str | list[int]],
    model_dir: str | Path,
    nsamples: int,
    seqlen: int,
    vocab_size: int,
    bos_token_id: int | None = None,
) -> list[list[int]]:
    """Token sequences for calibration (module docstring); refuses ids outside the vocabulary."""
    if nsamples < 1 or seqlen < 2:
        raise CalibrationError(f"need nsamples >= 1 and seqlen >= 2, got nsamples={nsamples}, seqlen={seqlen}")
    tokenizer = None
    samples: list[list[int]] = []
    for idx, item in enumerate(items):
        if isinstance(item, str):
            if tokenizer is None:
                tokenizer = _load_tokenizer(Path(model_dir))
            ids = tokenizer.encode(item).ids
            if bos_token_id is not None and (not ids or ids[0] != bos_token_id):
                ids = [bos_token_id, *ids]
        else:
            ids = item
        bad = [i for i in ids if i >= vocab_size]
        if bad:
            raise CalibrationError(f"calibration sample {idx}: token id {bad[0]} >= vocab_size {vocab_size}")
        for start in range(0, len(ids), seqlen):
            window = ids[start : start + seqlen]
            if len(window) >= 2:
                samples.append(window)
            if len(samples) == nsamples:
                return samples
    if not samples:
        raise CalibrationError("calibration set yields no sequence of at least 2 tokens")
    return samples


def _load_tokenizer(model_dir: Path):  # noqa: ANN202 (tokenizers.Tokenizer)
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise CalibrationError(f"{model_dir}: no tokenizer.json to tokenize the calibration texts with")
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))
