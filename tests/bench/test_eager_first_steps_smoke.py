"""``bench/eager_first_steps.py`` runs end to end in ``--smoke`` mode (the tiny shape on the CPU, where
nothing compiles): every case's steps are timed with the delta on the decodes and the prompt, and a
bad case spec is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import eager_first_steps


def test_eager_first_steps_smoke(tmp_path: Path) -> None:
    path = eager_first_steps.main(
        ["--smoke", "--warm-cache", "--cases", "0x8,2x5", "--steps", "2", "--out", str(tmp_path)]
    )
    r = json.loads(path.read_text())
    assert r["experiment"] == "eager_first_steps" and r["device"] == "cpu" and r["executor_start_s"] > 0
    assert [(c["decodes"], c["prompt"]) for c in r["cases"]] == [(0, 8), (2, 5)]
    assert all(len(c["step_ms"]) == 2 and min(c["step_ms"]) > 0 and c["compiled"] == [] for c in r["cases"])


@pytest.mark.parametrize("spec", ["8", "x8", "1x1", "-1x8"])
def test_bad_cases_are_refused(spec: str) -> None:
    with pytest.raises(SystemExit, match="--cases"):
        eager_first_steps.parse_cases(spec)
