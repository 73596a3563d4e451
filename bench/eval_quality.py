"""Task quality of compressed full fine-tunes, measured through the daemon (DeltaZip's accuracy table).

For each demo fine-tune (``python -m deltaserve.demo_finetunes --train``; one per task of
``deltaserve.demo_adapters``) this script:

1. compresses it with ``python -m deltaserve.compress`` (2:4 sparsity, group 64), four ways:
   the delta ``W_ft − W_base`` at 4 and 2 bits (ΔCompress), and the fine-tuned weights themselves at
   4 and 2 bits (``--full-weights``: the SparseGPT baseline). Calibration: the task's own training
   examples, token for token as the fine-tune saw them (DeltaZip §4.2 calibrates on the
   fine-tune's training data);
2. serves each delta the way deltaserve serves variants: the daemon on the base with
   ``--delta v=DIR`` (DeltaZip's decoupled forward: base once, plus the packed delta per token),
   requests for model ``<base>:v``; the baseline, which is not a delta, is materialised as a plain
   HF directory (``deltaserve.compress.delta_dir.materialize``, ``dequant(W̃)``, float32) and served
   with ``--model``;
3. starts the daemon (CPU worker, float32) on the base, the uncompressed fine-tune and each
   compressed variant in turn, sends the task's held-out prompts as chat completions
   (temperature 0) and scores exact matches after stripping whitespace, as
   ``tests/e2e/test_demo_adapters.py`` does.

Writes ``bench/results/eval_quality-<device>-<date>.json`` (``common.write_result``) and prints a
table: accuracy per variant, and for the compressed ones the payload bytes and the compression
ratio (fp16 fine-tune bytes ÷ payload bytes) from the manifest.

    python -m bench.eval_quality [--task json] [--heldout 80] [--nsamples 128] [--keep]

Compressed delta directories and materialised models go under ``--work``
(default ``$DELTASERVE_HOME/eval_quality``); materialised models (≈540 MB each) are deleted after
their evaluation unless ``--keep``; ``--reuse`` keeps compressed directories from an earlier run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from bench.common import write_result
from bench.launch import default_daemon, free_port, launch

#: (name, --full-weights, --bits) of the compressed variants, all 2:4-sparse.
COMPRESSED = (
    ("delta-4b-2:4", False, 4),
    ("delta-2b-2:4", False, 2),
    ("full-4b-2:4", True, 4),
    ("full-2b-2:4", True, 2),
)
#: Note stored in the result and printed under the table.
SERVING_NOTE = (
    "'delta-*' variants are served by the daemon as base + compressed delta (--delta, decoupled forward); the "
    "SparseGPT baseline 'full-*' as a materialised HF model dequant(W) (--model); float32 on CPU"
)


def ask_all(daemon: Path, model_dir: Path, prompts: list[str], max_tokens: int, log: Path,
            delta: Path | None = None) -> tuple[list[str], float]:  # fmt: skip
    """Starts the daemon on ``model_dir`` (CPU; with ``delta``, serving it as variant ``v`` and asking
    ``<base>:v``), sends every prompt as a greedy chat completion, at once; returns (answers in prompt
    order, stripped; seconds from first request to last answer)."""
    port = free_port()
    cmd = [str(daemon), "--port", str(port), "--python", sys.executable, "--devices", "cpu",
           "--model", str(model_dir)] + ([] if delta is None else ["--delta", f"v={delta}"])  # fmt: skip
    with launch(cmd, f"http://127.0.0.1:{port}", log, ready_timeout_s=600) as url:
        name = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        if delta is not None:
            name = f"{name}:v"

        def ask(msg: str) -> str:
            r = httpx.post(f"{url}/v1/chat/completions", timeout=600, json={
                "model": name, "messages": [{"role": "user", "content": msg}], "max_tokens": max_tokens,
                "temperature": 0,
            })  # fmt: skip
            if r.status_code != 200:
                raise RuntimeError(f"{model_dir}: HTTP {r.status_code} for {msg!r}: {r.text[:500]}")
            return r.json()["choices"][0]["message"]["content"].strip()

        t0 = time.monotonic()
        with ThreadPoolExecutor(16) as pool:
            got = list(pool.map(ask, prompts))
        return got, time.monotonic() - t0


def score(pairs: list[tuple[str, str]], got: list[str]) -> dict:
    """Exact-match accuracy and the first few misses as (want, got)."""
    misses = [(want, g) for (_, want), g in zip(pairs, got) if g != want]
    return {"accuracy": 1 - len(misses) / len(pairs), "hits": len(pairs) - len(misses), "n": len(pairs),
            "misses_sample": misses[:5]}  # fmt: skip


def write_calibration(task: str, base_dir: Path, path: Path) -> int:
    """The task's training examples as ``{"input_ids": [...]}`` lines (prompt + answer + <|im_end|>,
    chat-templated exactly as in training); returns how many."""
    from transformers import AutoTokenizer

    from deltaserve.demo_adapters import encode, examples

    tok = AutoTokenizer.from_pretrained(base_dir)
    rows = [encode(tok, m, a)[0] for m, a in examples(task, "train")]
    path.write_text("".join(json.dumps({"input_ids": ids}) + "\n" for ids in rows))
    return len(rows)


def compress(base: Path, finetuned: Path, out: Path, bits: int, full: bool, calib: Path, nsamples: int,
             log: Path) -> float:  # fmt: skip
    """Runs ``python -m deltaserve.compress`` into ``out`` (replacing it); returns seconds."""
    if out.exists():
        shutil.rmtree(out)
    cmd = [sys.executable, "-m", "deltaserve.compress", "--base", str(base), "--finetuned", str(finetuned),
           "--out", str(out), "--bits", str(bits), "--sparsity", "2:4", "--calib", str(calib),
           "--nsamples", str(nsamples), "--quiet"] + (["--full-weights"] if full else [])  # fmt: skip
    t0 = time.monotonic()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {rc}; log: {log}\n{log.read_text()[-3000:]}")
    return time.monotonic() - t0


def manifest_sizes(delta_dir: Path) -> dict:
    """Sizes and the mean per-linear relative output error from a delta directory's manifest."""
    from deltaserve.compress.delta_dir import read_manifest

    m = read_manifest(delta_dir)
    errs = [t["rel_error"] for t in m["tensors"].values() if t.get("kind") == "packed" and "rel_error" in t]
    dense = sum(t["bytes"] for t in m["tensors"].values() if t.get("kind") == "dense")
    return {"mode": m["mode"], "payload_bytes": m["sizes"]["payload_bytes"],
            "finetuned_fp16_bytes": m["sizes"]["finetuned_fp16_bytes"],
            "compression_ratio": m["sizes"]["compression_ratio"], "dense_bytes": dense,
            "mean_rel_error": sum(errs) / len(errs) if errs else None,
            "calibration": m["compression"].get("calibration")}  # fmt: skip


def evaluate_task(task: str, args, base_dir: Path, daemon: Path, work: Path, base_answers: list[str]) -> dict:
    from deltaserve.compress.delta_dir import materialize
    from deltaserve.demo_adapters import examples

    pairs = examples(task, "heldout")[: args.heldout]
    prompts = [m for m, _ in pairs]
    ft_dir = args.finetunes / task
    if not (ft_dir / "config.json").is_file():
        raise SystemExit(f"no fine-tune at {ft_dir}: run `python -m deltaserve.demo_finetunes --train --task {task}`")
    tdir = work / task
    tdir.mkdir(parents=True, exist_ok=True)
    calib = tdir / "calib.jsonl"
    ncalib = write_calibration(task, base_dir, calib)
    rows: dict[str, dict] = {"base": score(pairs, base_answers)}
    got, secs = ask_all(daemon, ft_dir, prompts, args.max_tokens, tdir / "daemon-finetune.log")
    rows["finetune"] = {**score(pairs, got), "serve_seconds": round(secs, 1)}
    _progress(task, "finetune", rows["finetune"])
    for name, full, bits in COMPRESSED:
        ddir = tdir / name.replace(":", "of")
        if args.reuse and (ddir / "manifest.json").is_file():
            csecs = None
        else:
            csecs = compress(base_dir, ft_dir, ddir, bits, full, calib, args.nsamples, tdir / f"{ddir.name}.log")
        log = tdir / f"daemon-{ddir.name}.log"
        if not full:  # a delta: served as base + delta
            got, secs = ask_all(daemon, base_dir, prompts, args.max_tokens, log, delta=ddir)
        else:
            mdir = tdir / f"{ddir.name}-model"
            if mdir.exists():
                shutil.rmtree(mdir)
            materialize(ddir, base_dir, mdir)
            try:
                got, secs = ask_all(daemon, mdir, prompts, args.max_tokens, log)
            finally:
                if not args.keep:
                    shutil.rmtree(mdir)
        rows[name] = {
            **score(pairs, got),
            **manifest_sizes(ddir),
            "compress_seconds": None if csecs is None else round(csecs, 1),
            "serve_seconds": round(secs, 1),
        }
        _progress(task, name, rows[name])
    marker = ft_dir / "deltaserve-finetune.json"
    return {"finetune_dir": str(ft_dir), "finetune_recipe": json.loads(marker.read_text()) if marker.is_file() else None,
            "heldout": len(pairs), "calibration_samples": min(ncalib, args.nsamples), "variants": rows}  # fmt: skip


def _progress(task: str, name: str, row: dict) -> None:
    print(f"[{task}] {name}: {row['hits']}/{row['n']}", file=sys.stderr, flush=True)


def format_table(results: dict) -> str:
    lines = [f"{'task':<6} {'variant':<13} {'accuracy':>9} {'hits':>7} {'payload MB':>11} {'ratio':>6} "
             f"{'rel err':>8}"]  # fmt: skip
    for task, r in results.items():
        for name, v in r["variants"].items():
            mb = f"{v['payload_bytes'] / 1e6:.1f}" if "payload_bytes" in v else "-"
            ratio = f"{v['compression_ratio']:.2f}" if "compression_ratio" in v else "-"
            err = f"{v['mean_rel_error']:.4f}" if v.get("mean_rel_error") is not None else "-"
            lines.append(f"{task:<6} {name:<13} {v['accuracy']:>8.0%} {v['hits']:>3}/{v['n']:<3} {mb:>11} "
                         f"{ratio:>6} {err:>8}")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> Path:
    from deltaserve.demo_adapters import HELDOUT_SIZE, TASKS
    from deltaserve.demo_finetunes import default_root
    from deltaserve.demo_model import deltaserve_home

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--task", action="append", choices=sorted(TASKS), help="default: every task with a fine-tune")
    p.add_argument(
        "--finetunes", type=Path, default=None, help="fine-tune root (default: demo_finetunes'); TASK/ in it"
    )
    p.add_argument("--model", type=Path, default=None, help="base model dir (default: the demo model)")
    p.add_argument("--work", type=Path, default=None, help="compressed and materialised models (default: "
                   "$DELTASERVE_HOME/eval_quality)")  # fmt: skip
    p.add_argument(
        "--heldout", type=int, default=HELDOUT_SIZE, help=f"held-out prompts per task (default {HELDOUT_SIZE})"
    )
    p.add_argument("--nsamples", type=int, default=128, help="calibration sequences for compress (default 128)")
    p.add_argument("--max-tokens", type=int, default=16, help="max tokens per answer (default 16)")
    p.add_argument("--daemon", type=Path, default=None, help="deltaserve binary (default: $DELTASERVE_BIN, "
                   "target/release, target/debug)")  # fmt: skip
    p.add_argument("--reuse", action="store_true", help="reuse compressed directories already in --work")
    p.add_argument("--keep", action="store_true", help="keep the materialised models")
    p.add_argument("--out-dir", type=Path, default=None, help="where the result JSON goes (default bench/results)")
    args = p.parse_args(argv)
    if not 1 <= args.heldout <= HELDOUT_SIZE:
        p.error(f"--heldout must be in 1..{HELDOUT_SIZE}, got {args.heldout}")
    if args.nsamples < 1 or args.max_tokens < 1:
        p.error("--nsamples and --max-tokens must be >= 1")
    args.finetunes = args.finetunes or default_root()
    if args.model is None:
        from deltaserve.demo_model import default_out_dir

        args.model = default_out_dir()
    if not (args.model / "config.json").is_file():
        p.error(f"--model {args.model} holds no config.json (run `python -m deltaserve.demo_model`)")
    tasks = args.task or [t for t in sorted(TASKS) if (args.finetunes / t / "config.json").is_file()]
    if not tasks:
        p.error(f"no fine-tunes under {args.finetunes}: run `python -m deltaserve.demo_finetunes --train`")
    daemon = args.daemon or default_daemon()
    work = args.work or deltaserve_home() / "eval_quality"
    work.mkdir(parents=True, exist_ok=True)

    from deltaserve.demo_adapters import examples

    # One daemon on the base answers every task's prompts.
    all_pairs = {t: examples(t, "heldout")[: args.heldout] for t in tasks}
    prompts = [m for t in tasks for m, _ in all_pairs[t]]
    got, _ = ask_all(daemon, args.model, prompts, args.max_tokens, work / "daemon-base.log")
    base_answers, i = {}, 0
    for t in tasks:
        base_answers[t], i = got[i : i + len(all_pairs[t])], i + len(all_pairs[t])
    results = {t: evaluate_task(t, args, args.model, daemon, work, base_answers[t]) for t in tasks}

    table = format_table(results)
    payload = {"device": "cpu", "serving": SERVING_NOTE, "base_model": str(args.model),
               "daemon": str(daemon), "dtype": "float32", "sparsity": "2:4", "group_size": 64,
               "heldout_per_task": args.heldout, "nsamples": args.nsamples, "max_tokens": args.max_tokens,
               "metric": "exact match after stripping whitespace, greedy (temperature 0), through the daemon",
               "tasks": results, "table": table.splitlines()}  # fmt: skip
    path = write_result("eval_quality", payload, args.out_dir)
    print(table)
    print(f"\nNote: {SERVING_NOTE}.")
    print(path)
    return path


if __name__ == "__main__":
    main()
