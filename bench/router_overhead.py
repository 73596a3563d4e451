"""Router + IPC overhead per step: the time between the worker writing step N's output and having
decoded step N+1's plan (the worker measures it and reports ``StepTiming.gap_us``; the router
exposes percentiles at ``/metrics``), with 64 requests running.

Starts the real daemon (release binary) on a random-weight model, streams 64 concurrent
completions (prompt 128 tokens, 256 output tokens, EOS ignored), then reads the gap percentiles
and the output tokens/s. ``--overlap-steps false`` runs the daemon one step at a time (the
default sends step N+1 ahead; its gap is then mostly 0, and tokens/s is the measure).

    python3 -m bench.router_overhead --daemon target/release/deltaserve --device 0 [--shape llama-2-7b]
    python3 -m bench.router_overhead --daemon target/release/deltaserve --device cpu --shape tiny   # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from bench.common import RANDOM_WEIGHTS_FILE, SHAPES, write_random_model_dir, write_result, write_word_tokenizer

TINY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 32000,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def stream_one(url: str, body: dict, errors: list) -> None:
    req = urllib.request.Request(
        f"{url}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            for line in r:
                if line.startswith(b"data: [DONE]"):
                    return
    except Exception as e:  # noqa: BLE001 - recorded and reported
        errors.append(repr(e))


def metrics(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line and line[0] != "#"
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--daemon", type=Path, required=True)
    p.add_argument("--device", default="0", help="`cpu` or a CUDA id")
    p.add_argument("--shape", default="llama-2-7b", choices=[*SHAPES, "tiny"])
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--overlap-steps", default="true", choices=["true", "false"])
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / args.shape
        if args.shape == "tiny":
            model_dir.mkdir()
            (model_dir / "config.json").write_text(json.dumps(TINY))
            (model_dir / RANDOM_WEIGHTS_FILE).write_text(json.dumps({"seed": 0, "std": 0.02}))
        else:
            write_random_model_dir(args.shape, model_dir)
        write_word_tokenizer(model_dir, json.loads((model_dir / "config.json").read_text())["vocab_size"])
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        url = f"http://127.0.0.1:{port}"
        dtype = "float32" if args.device == "cpu" else "float16"
        log = open(Path(tmp) / "daemon.log", "w+")
        proc = subprocess.Popen(
            [
                str(args.daemon),
                "--model",
                str(model_dir),
                "--devices",
                args.device,
                "--python",
                args.python,
                "--dtype",
                dtype,
                "--port",
                str(port),
                "--overlap-steps",
                args.overlap_steps,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            deadline = time.time() + 600
            while True:
                try:
                    if urllib.request.urlopen(f"{url}/ready", timeout=2).status == 200:
                        break
                except OSError:
                    pass
                if proc.poll() is not None or time.time() > deadline:
                    log.seek(0)
                    raise SystemExit(f"daemon did not start:\n{log.read()[-3000:]}")
                time.sleep(0.5)
            rng = random.Random(0)
            vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
            errors: list[str] = []
            threads = []
            t0 = time.time()
            for _ in range(args.concurrency):
                body = {
                    "prompt": [rng.randrange(3, vocab) for _ in range(args.prompt_len)],
                    "max_tokens": args.max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                    "stream": True,
                }
                threads.append(threading.Thread(target=stream_one, args=(url, body, errors)))
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.time() - t0
            m = metrics(url)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    device = "cpu"
    if args.device != "cpu":
        import torch

        device = torch.cuda.get_device_name(int(args.device))
    result = {
        "device": device,
        "shape": args.shape,
        "concurrency": args.concurrency,
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "errors": errors,
        "wall_s": wall,
        "overlap_steps": args.overlap_steps == "true",
        "steps": m["deltaserve_steps_total"],
        "steps_ahead": m["deltaserve_steps_ahead_total"],
        "tokens": m["deltaserve_tokens_generated_total"],
        "gap_us_p50": m["deltaserve_step_gap_us_p50"],
        "gap_us_p99": m["deltaserve_step_gap_us_p99"],
        "router_us_p50": m["deltaserve_step_router_us_p50"],
        "router_us_p99": m["deltaserve_step_router_us_p99"],
        "output_tokens_per_s": m["deltaserve_tokens_generated_total"] / wall,
    }
    print(json.dumps(result, indent=1))
    print(f"wrote {write_result('router_overhead', result, args.out)}")


if __name__ == "__main__":
    main()
