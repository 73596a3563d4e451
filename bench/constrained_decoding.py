"""Cost of constrained decoding (``response_format`` JSON schemas; ``worker/guidance.py``): decode
steps through the real worker executor at batch B with 0, 16 or B JSON-schema rows, against the
same steps unconstrained, and the grammar masks' host time per step.

Model: random weights of ``--shape`` (Llama-2-7B by default, fp16/bf16) with a real tokenizer
(``--tokenizer``, a ``tokenizer.json``; its vocabulary sets the model's), since the mask cost
depends on the vocabulary. B requests whose first ``--ctx`` tokens are in the KV cache decode
``--steps`` tokens, overlapped as the worker loop runs them (step N+1 launched before step N is
finished; timed from one finish to the next). Constrained rows carry the grammar the router
writes for a ``json_schema`` response format; each step their matchers consume the token the step
before sampled (the runner waits for that step's sampled tokens, not for the forward it just
queued) and fill the masks while the device runs the forward (see ``guidance.py``).

Per case: ``step_us`` (median), ``ratio`` (to the unconstrained case; the target is <= 1.05),
``mask_us`` (median host time of ``GrammarGate.masks`` per step: consuming, filling, the copy
queued) and ``active_rows`` (constrained rows whose grammar was not complete at the end: a
complete grammar's mask allows only EOS, which costs nothing to compute).

    python3 -m bench.constrained_decoding --tokenizer PATH/tokenizer.json [--batch 64] [--constrained 0,16,64]
    python3 -m bench.constrained_decoding --smoke     # CPU, tiny shapes: checks the script only
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench import script_env

script_env.prepare()  # deltaserve importable from pyworker/

from bench.common import SHAPES, device_name, write_random_model_dir, write_result  # noqa: E402
from bench.plans import new_request  # noqa: E402
from deltaserve import wire  # noqa: E402
from deltaserve.worker.executor import Executor  # noqa: E402

#: The schema of the constrained rows: strings and an array without bounds keep a random model's
#: grammar open for the whole run (what a long structured answer costs).
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}}},
    },
    "required": ["name", "age", "tags", "address"],
}
#: As ``validate/response_format.rs`` writes it.
OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
GRAMMAR = json.dumps({"grammars": [{"json_schema": {**SCHEMA, "x-guidance": OPTIONS}}]})
DEFAULT_TOKENIZER = Path.home() / ".cache/deltaserve/models/SmolLM2-135M-Instruct/tokenizer.json"


class MaskTimer:
    """Wraps ``GrammarGate.masks`` of an executor and records its host time per call."""

    def __init__(self, ex: Executor) -> None:
        self.times: list[float] = []
        gate = ex.guidance
        inner = gate.masks

        def timed(*args, **kw):
            t0 = time.perf_counter()
            out = inner(*args, **kw)
            self.times.append(time.perf_counter() - t0)
            return out

        gate.masks = timed  # type: ignore[method-assign]


def run_case(ex: Executor, batch: int, constrained: int, ctx: int, steps: int, warmup: int, first_id: int):
    """Median step seconds, the mask times, and the constrained rows still open at the end."""
    bs = ex.block_size
    blocks_per_req = (ctx + steps + warmup + 2 + bs - 1) // bs
    assert batch * blocks_per_req <= ex.num_blocks, "KV pool too small for this batch"
    g = torch.Generator().manual_seed(batch)
    new = []
    for i in range(batch):
        sampling = wire.SamplingParams(temperature=0.0, top_p=1.0, grammar=GRAMMAR if i < constrained else None)
        tokens = torch.randint(3, ex.config.vocab_size, (ctx + 1,), generator=g).tolist()
        blocks = range(i * blocks_per_req, (i + 1) * blocks_per_req)
        new.append(new_request(first_id + i, tokens, blocks, ctx, 1, sampling=sampling))
    ids = [r.req_id for r in new]
    step_id = first_id * 1000
    out = ex.step(wire.StepPlan(step_id=step_id, new_requests=new))
    assert not out.refused_requests, out.refused_requests
    timer = MaskTimer(ex)
    times = []
    in_flight, last_finish = None, 0.0
    for s in range(warmup + steps):
        running = [wire.RunningRequest(req_id=r, num_scheduled_tokens=1, new_block_ids=[]) for r in ids]
        launched = ex.launch(wire.StepPlan(step_id=step_id + s + 1, running=running), in_flight)
        if in_flight is not None:
            ex.finish(in_flight)
            now = time.perf_counter()
            if s > warmup:
                times.append(now - last_finish)
            last_finish = now
        in_flight = launched
    assert in_flight is not None
    ex.finish(in_flight)
    open_rows = sum(
        1 for r in ids[:constrained] if (c := ex.requests[r].grammar) is not None and not c.matcher.is_stopped()
    )
    ex.step(wire.StepPlan(step_id=step_id + warmup + steps + 1, released=ids))
    del ex.guidance.masks  # the class's method again
    return statistics.median(times), timer.times[warmup:], open_rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-2-7b", choices=sorted(SHAPES))
    ap.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--constrained", default="0,16,64", help="constrained rows per case")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--cuda-graphs", type=int, default=256, help="cuda_graph_max_batch (0: eager)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--model-dir", type=Path, default=None, help="serve this HF directory instead (smoke tests)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.smoke:
        args.batch, args.constrained, args.ctx, args.steps, args.warmup = 4, "0,2,4", 8, 6, 2
        args.device, args.cuda_graphs = "cpu", 0
    elif not torch.cuda.is_available():
        raise SystemExit("bench.constrained_decoding needs a CUDA device (or --smoke)")
    cases = [int(c) for c in args.constrained.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir
        if model_dir is None:
            if not args.tokenizer.is_file():
                raise SystemExit(f"--tokenizer {args.tokenizer}: no such file (a tokenizer.json is needed)")
            model_dir = write_random_model_dir(args.shape, Path(tmp) / "model")
            config = json.loads((model_dir / "config.json").read_text())
            shutil.copy(args.tokenizer, model_dir / "tokenizer.json")
            import llguidance

            config["vocab_size"] = llguidance.LLTokenizer(args.tokenizer.read_text()).vocab_size
            (model_dir / "config.json").write_text(json.dumps(config))
        ex = Executor(
            model_dir,
            device=args.device,
            dtype="auto",
            block_size=16,
            kv_cache_bytes=0 if args.device != "cpu" else 8 << 20,
            cuda_graph_max_batch=args.cuda_graphs,
            max_lora_rank=0,
            max_deltas=0,
        )
        results = []
        base_us = None
        for i, constrained in enumerate(cases):
            step_s, masks, open_rows = run_case(
                ex, args.batch, min(constrained, args.batch), args.ctx, args.steps, args.warmup, (i + 1) * 100_000
            )
            step_us = step_s * 1e6
            if constrained == 0:
                base_us = step_us
            row = {
                "batch": args.batch,
                "constrained": constrained,
                "step_us": round(step_us, 1),
                "ratio": round(step_us / base_us, 3) if base_us else None,
                "mask_us": round(statistics.median(masks) * 1e6, 1) if masks else 0.0,
                "mask_us_p90": round(sorted(masks)[int(0.9 * (len(masks) - 1))] * 1e6, 1) if masks else 0.0,
                "active_rows": open_rows,
            }
            results.append(row)
            print(row, flush=True)
        payload = {
            "device": device_name(ex.device),
            "shape": args.shape if args.model_dir is None else str(args.model_dir),
            "vocab": ex.config.vocab_size,
            "dtype": str(ex.dtype),
            "ctx": args.ctx,
            "steps": args.steps,
            "cuda_graphs": args.cuda_graphs,
            "schema": SCHEMA,
            "results": results,
        }
    if not args.smoke:
        print(write_result("constrained_decoding", payload, args.out))
    else:
        print(json.dumps(payload)[:400])


if __name__ == "__main__":
    main()
