"""Cost of the logit-shaping request options in the sampler: ``logit_bias``, the ``min_tokens`` ban
and the presence / frequency / repetition penalties (``deltaserve/worker/logit_adjust.py``).

One sampling step of S rows over a vocabulary V (float32 logits, as the model hands them over),
greedy and seeded-sampled rows half and half, with 0, 16 or all S rows using each option:

    none        no row has an option (the baseline: nothing is copied)
    bias        10 ``logit_bias`` entries per row
    ban         ``min_tokens`` active: 2 banned ids per row
    penalties   presence + frequency + repetition; each row has a P-token prompt and O output tokens
                known on the host and one token in flight (the overlapped step's), as in serving

Per case: ``launch_us``, the host time of ``Sampler.launch`` (what delays the next step's launch),
and ``step_us``, launch to the tokens on the host (``LaunchedSample.result``); medians of
``--runs`` after a warm-up. The penalties rebuild their counts from the host's tokens every step,
so their cost grows with P + O; that is what this measures.

    python3 -m bench.sampler_options [--rows 64,256] [--vocab 151936] [--prompt 2048] [--outputs 256]
    python3 -m bench.sampler_options --smoke      # CPU, tiny shapes: checks the script only
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.common import device_name, write_result
from deltaserve import wire
from deltaserve.worker.sampler import Sampler


@dataclass
class History:
    token_ids: list[int]
    num_prompt_tokens: int
    prompt_on_device: torch.Tensor | None = None


def params_for(option: str, row: int, vocab: int) -> wire.SamplingParams:
    """Row ``row``'s params: greedy on even rows, seeded sampling on odd ones, plus ``option``."""
    p = wire.SamplingParams(temperature=0.0 if row % 2 == 0 else 0.8, top_p=1.0, seed=None if row % 2 == 0 else row)
    if option == "bias":
        p.logit_bias = [wire.LogitBias(token_id=(row * 37 + j * 101) % vocab, bias=2.0) for j in range(10)]
    elif option == "ban":
        p.min_tokens, p.min_tokens_banned = 1 << 20, [0, 1]
    elif option == "penalties":
        p.penalties = wire.Penalties(presence=0.5, frequency=0.5, repetition=1.1)
    return p


def time_case(sampler: Sampler, logits: torch.Tensor, params, history, in_flight, runs: int) -> tuple[float, float]:
    """Median (launch_us, step_us)."""
    launches, steps = [], []
    for i in range(runs + 3):
        if logits.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        launched = sampler.launch(logits, params, [5] * len(params), history, in_flight)
        t1 = time.perf_counter()
        launched.result()
        t2 = time.perf_counter()
        if i >= 3:
            launches.append((t1 - t0) * 1e6)
            steps.append((t2 - t0) * 1e6)
    return statistics.median(launches), statistics.median(steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="64,256")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--prompt", type=int, default=2048, help="prompt tokens per penalized row")
    ap.add_argument("--outputs", type=int, default=256, help="output tokens per penalized row")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.smoke:
        args.rows, args.vocab, args.prompt, args.outputs, args.runs, args.device = "4,8", 512, 16, 8, 2, "cpu"
    elif not torch.cuda.is_available():
        raise SystemExit("bench.sampler_options needs a CUDA device (or --smoke)")
    device = torch.device(args.device)
    sampler = Sampler(device, seed=0)
    gen = torch.Generator().manual_seed(0)
    rows_out = []
    for num_rows in [int(r) for r in args.rows.split(",")]:
        logits = (torch.randn(num_rows, args.vocab, generator=gen) * 3).to(device)
        history = [
            History(torch.randint(0, args.vocab, (args.prompt + args.outputs,), generator=gen).tolist(), args.prompt)
            for _ in range(num_rows)
        ]
        in_flight = torch.randint(0, args.vocab, (num_rows,), generator=gen).to(device)
        for option in ("none", "bias", "ban", "penalties"):
            for using in sorted({0, min(16, num_rows), num_rows}) if option != "none" else [0]:
                params = [params_for(option if r < using else "none", r, args.vocab) for r in range(num_rows)]
                launch_us, step_us = time_case(sampler, logits, params, history, in_flight, args.runs)
                row = {"rows": num_rows, "option": option, "rows_using": using}
                row |= {"launch_us": round(launch_us, 1), "step_us": round(step_us, 1)}
                rows_out.append(row)
                print(row, flush=True)
    payload = {
        "device": device_name(device),
        "vocab": args.vocab,
        "prompt_tokens": args.prompt,
        "output_tokens": args.outputs,
        "runs": args.runs,
        "results": rows_out,
    }
    if not args.smoke:
        print(write_result("sampler_options", payload, args.out))


if __name__ == "__main__":
    main()
