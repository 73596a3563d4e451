"""``bench/constrained_decoding.py`` runs end to end on the CPU (``--smoke`` on the tiny Llama, whose
tokenizer is a real BPE one): every case reports a step time, the constrained cases a mask time,
and every constrained row's grammar is still open (the schema keeps a random model busy)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from bench import constrained_decoding


def test_smoke_runs_and_reports_every_case(tiny_llama: Path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(sys, "argv", ["constrained_decoding", "--smoke", "--model-dir", str(tiny_llama)])
    constrained_decoding.main()
    rows = [ast.literal_eval(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{'batch'")]
    assert [r["constrained"] for r in rows] == [0, 2, 4]
    assert all(r["step_us"] > 0 for r in rows) and rows[0]["ratio"] == 1.0
    assert rows[0]["mask_us"] == 0.0 and all(r["mask_us"] > 0 for r in rows[1:])
    assert [r["active_rows"] for r in rows] == [0, 2, 4]
