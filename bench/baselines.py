"""The baselines deltaserve is measured against, speaking the daemon's HTTP API subset that
bench/replay.py uses, so bench/serving runs them like the daemon (``--server peft|swap|merged``).
This module is the server program of ``peft`` and ``swap``; bench/serving/servers.py starts it (and
the ``merged`` daemon) and imports nothing from it: it is a child process, not a library.

    peft    S-LoRA's "PEFT" baseline: HF transformers + peft, ONE adapter active at a time.
            Requests queue per adapter; the engine takes the adapter whose oldest request waited
            longest, ``set_adapter``s it (loading it with ``load_adapter`` from --lora-dir when it
            is not on the device; at most --device-adapters stay there, least recently used
            dropped with ``delete_adapter``), and runs up to --max-batch of its requests to
            completion. Requests arriving meanwhile wait for the next batch.
    swap    DeltaZip's whole-model swapping for full fine-tunes: --resident K device slots, each
            a full model; a variant not in a slot is read from its HF directory (safetensors,
            straight to the device) into the least recently used slot. Batches only requests of
            one model, picked and run as in ``peft``. ``--resident auto`` holds as many full
            models as fit (DeltaZip's vLLM-SCB does): :func:`models_that_fit`.
    merged  The upper bound: the deltaserve daemon serving ONE variant merged into the base
            (peft ``merge_and_unload``), every request's model mapped to it (launch.Endpoint.model).

Process layout (peft, swap)::

    python -m bench.baselines peft|swap ...           one process, started by bench/serving/servers.py
      asyncio thread   HTTP/SSE (bench/http_sse.py): /ready, /health, /stats, /v1/models,
                       POST /v1/completions → Pending into Engine.queues, tokens back through an
                       asyncio.Queue per request (loop.call_soon_threadsafe)
      engine thread    Engine.run: pick variant → activate() → generate() a batch

Generation (:func:`generate`): greedy, forced to each request's max_tokens (EOS ignored), the
decode loop written out with ``past_key_values`` so every token is streamed when it is made;
prompts left-padded, with an attention mask and position ids that skip the padding. The batch
runs until its longest request is done (as HF ``generate`` does); finished rows stop streaming.

SSE chunks are the daemon's (text per token: the tokenizer's piece when the model directory has
a tokenizer, else ``" <id>"``), plus ``choices[0].token_ids`` (tests compare tokens), a finish
chunk, a usage chunk with include_usage, ``[DONE]``. ``GET /stats`` returns the engine's counters
(:meth:`Engine.stats`): resident variants, the most ever resident at once, loads, batches (swap
also its number of device slots).

Models: an HF directory with weights, or a ``random-weights.json`` directory (bench/common.py),
whose weights are drawn N(0, std) on the device (peft only; swap needs real files to swap).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import http_sse
from bench.common import RANDOM_WEIGHTS_FILE, adapter_dirs, checkpoint_dtype

BASELINES = ("peft", "swap")
"""Engines this file's server runs (``merged`` is the daemon)."""


# ---------------------------------------------------------------------------------------------
# Requests and the engine loop


@dataclass
class Pending:
    """One accepted completion request, between the HTTP handler and the engine thread."""

    model: str
    """The variant it asks for (a key of ``Engine.variants``)."""
    prompt: list[int]
    """Prompt token ids."""
    max_tokens: int
    """Exactly this many tokens are generated (EOS is ignored)."""
    arrival: float
    """``time.monotonic()`` when it was queued: the engine serves the oldest waiting first."""
    deliver: Any
    """Thread-safe callback taking a token id, ``None`` (finished) or an ``Exception``."""


class Engine:
    """Per-variant queues and the loop that serves one variant's batch at a time; subclasses say
    how a variant becomes the active model (:meth:`activate`)."""

    def __init__(self, variants: dict[str, Path], device: Any, max_batch: int) -> None:
        self.variants = variants
        """Servable variant name → its directory (adapter or full model)."""
        self.device = device
        """The ``torch.device`` every model runs on."""
        self.max_batch = max_batch
        """Most requests in one batch."""
        self.queues: dict[str, deque[Pending]] = {}
        """Waiting requests per variant, oldest first."""
        self.cond = threading.Condition()
        """Guards ``queues``; notified when a request is queued."""
        self.counters = {"batches": 0, "requests": 0, "loads": 0, "switches": 0, "max_resident": 0}
        """What /stats reports beside the resident set: batches run, requests served, variants
        loaded onto the device, changes of the active variant, most variants resident at once."""
        self.active: str | None = None
        """The variant the last batch ran."""

    # -- subclass interface -------------------------------------------------------------------

    def activate(self, variant: str) -> Any:
        """Makes ``variant`` runnable on the device (loading / swapping as needed); returns the model."""
        raise NotImplementedError

    def resident(self) -> list[str]:
        """Variants whose weights are on the device now."""
        raise NotImplementedError

    # -- shared -------------------------------------------------------------------------------

    def submit(self, p: Pending) -> None:
        with self.cond:
            self.queues.setdefault(p.model, deque()).append(p)
            self.cond.notify()

    def _note_resident(self) -> None:
        self.counters["max_resident"] = max(self.counters["max_resident"], len(self.resident()))

    def stats(self) -> dict:
        with self.cond:
            waiting = sum(len(q) for q in self.queues.values())
        return {**self.counters, "resident": self.resident(), "active": self.active, "waiting": waiting}

    def next_batch(self) -> tuple[str, list[Pending]]:
        """Blocks until a request waits; the variant with the oldest waiting request and up to
        ``max_batch`` of its requests (oldest first)."""
        with self.cond:
            while not any(self.queues.values()):
                self.cond.wait()
            variant = min((q[0].arrival, v) for v, q in self.queues.items() if q)[1]
            q = self.queues[variant]
            return variant, [q.popleft() for _ in range(min(len(q), self.max_batch))]

    def run(self) -> None:
        """The engine thread: forever, one variant's batch to completion."""
        import torch

        while True:
            variant, batch = self.next_batch()
            try:
                with torch.inference_mode():
                    model = self.activate(variant)
                    if variant != self.active:
                        self.counters["switches"] += 1
                    self.active = variant
                    self._note_resident()
                    generate(model, batch, self.device)
                self.counters["batches"] += 1
                self.counters["requests"] += len(batch)
            except Exception as e:  # noqa: BLE001 - a failed batch fails its requests, not the server
                print(f"batch of {variant!r} failed: {e!r}", file=sys.stderr, flush=True)
                for p in batch:
                    p.deliver(RuntimeError(f"{variant}: {type(e).__name__}: {e}"))


def generate(model: Any, batch: list[Pending], device: Any) -> None:
    """Greedy decoding of ``batch`` on ``model``, each request forced to its ``max_tokens``,
    every token delivered when it is made (see the module docstring)."""
    import torch

    n = len(batch)
    width = max(len(p.prompt) for p in batch)
    ids = torch.zeros((n, width), dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    for i, p in enumerate(batch):
        ids[i, width - len(p.prompt) :] = torch.tensor(p.prompt)
        mask[i, width - len(p.prompt) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    past = None
    steps = max(p.max_tokens for p in batch)
    for step in range(steps):
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=past, use_cache=True)
        past = out.past_key_values
        nxt = out.logits[:, -1, :].argmax(-1)
        tokens = nxt.tolist()
        for p, t in zip(batch, tokens):
            if step < p.max_tokens:
                p.deliver(t)
                if step + 1 == p.max_tokens:
                    p.deliver(None)
        ids = nxt[:, None]
        mask = torch.cat([mask, mask.new_ones((n, 1))], dim=1)
        positions = positions[:, -1:] + 1


# ---------------------------------------------------------------------------------------------
# Models


def torch_device(devices: str) -> Any:
    """``cpu`` → cpu; a CUDA id (``0``) → ``cuda:0`` (the baselines run on one device)."""
    import torch

    if devices == "cpu":
        return torch.device("cpu")
    ids = devices.split(",")
    if len(ids) != 1 or not ids[0].isdigit():
        raise SystemExit(f"--devices {devices!r}: the baselines run on one device: `cpu` or one CUDA id such as `0`")
    return torch.device(f"cuda:{ids[0]}")


def model_dtype(model_dir: Path, device: Any, dtype: str) -> Any:
    """float32 on CPU, else the checkpoint's dtype (float16 when it names none), unless ``dtype`` says."""
    import torch

    if dtype != "auto":
        return getattr(torch, dtype)
    return torch.float32 if device.type == "cpu" else checkpoint_dtype(model_dir)


def load_model(model_dir: Path, device: Any, dtype: Any) -> Any:
    """An HF causal LM on ``device``: from its weights, or drawn N(0, std) for a random-weights dir."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    rw = model_dir / RANDOM_WEIGHTS_FILE
    if not rw.is_file():
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, device_map={"": device}).eval()
    spec = json.loads(rw.read_text())
    cfg = AutoConfig.from_pretrained(model_dir)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    gen = torch.Generator(device).manual_seed(int(spec.get("seed", 0)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, float(spec.get("std", 0.02)), generator=gen)
    return model.eval()


def model_dirs(models_dir: Path) -> dict[str, Path]:
    """Every subdirectory of ``models_dir`` with a config.json and safetensors weights, by name."""
    found = {}
    for d in sorted(Path(models_dir).iterdir()):
        if (d / "config.json").is_file():
            if not list(d.glob("*.safetensors")):
                raise SystemExit(f"--models-dir {models_dir}: {d.name} has a config.json but no *.safetensors "
                                 "(whole-model swapping reads real weight files)")  # fmt: skip
            found[d.name] = d
    if not found:
        raise SystemExit(f"--models-dir {models_dir}: no subdirectory has a config.json")
    return found


def models_that_fit(free_bytes: int, model_bytes: int, reserve_bytes: int, n_models: int) -> int:
    """How many full models of ``model_bytes`` fit in ``free_bytes`` once ``reserve_bytes`` are
    kept for a batch's KV cache and logits: at least 1 (a single model that does not fit fails
    when it is loaded, with the allocator's message), at most ``n_models``."""
    return max(1, min(n_models, (free_bytes - reserve_bytes) // max(model_bytes, 1)))


def batch_reserve_bytes(model_dir: Path, dtype: Any, max_batch: int, max_seq: int) -> int:
    """Device bytes one batch of ``max_batch`` sequences of ``max_seq`` tokens needs beside the
    weights: its KV cache (2 × layers × KV heads × head size per token, in ``dtype``), the
    prompt's logits (fp32, every position, as the decode loop of :func:`generate` computes them)
    and 1 GiB for the other activations."""
    import torch

    cfg = json.loads((model_dir / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    kv_per_token = 2 * cfg["num_hidden_layers"] * cfg.get("num_key_value_heads", heads) * head_dim
    tokens = max_batch * max_seq
    elem = torch.empty((), dtype=dtype).element_size()
    return tokens * kv_per_token * elem + tokens * cfg["vocab_size"] * 4 + (1 << 30)


def resident_slots(
    resident: str, models: dict[str, Path], device: Any, dtype: Any, max_batch: int, max_seq: int
) -> int:
    """``--resident``: a number, or ``auto``: :func:`models_that_fit` in the device's free memory
    (the host's available memory on the CPU), each model the size of the first one's safetensors."""
    if resident != "auto":
        try:
            k = int(resident)
        except ValueError:
            raise SystemExit(f"--resident {resident!r}: want a number of models or 'auto'") from None
        if k < 1:
            raise SystemExit(f"--resident {k}: need at least 1 model on the device")
        return k
    import torch

    first = next(iter(models.values()))
    model_bytes = sum(f.stat().st_size for f in first.glob("*.safetensors"))
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    k = models_that_fit(free, model_bytes, batch_reserve_bytes(first, dtype, max_batch, max_seq), len(models))
    print(
        f"--resident auto: {k} of {len(models)} models ({model_bytes / 2**30:.2f} GiB each, "
        f"{free / 2**30:.1f} GiB free on {device})",
        flush=True,
    )
    return k


class PeftEngine(Engine):
    """One base model wrapped by peft; adapters loaded into it on demand, one active per batch.
    A load happens before the eviction it forces, so for that moment capacity + 1 are loaded
    (``max_resident`` counts after the eviction)."""

    def __init__(self, model_dir: Path, adapters: dict[str, Path], device: Any, dtype: Any, max_batch: int,
                 device_adapters: int) -> None:  # fmt: skip
        from peft import PeftModel

        super().__init__(adapters, device, max_batch)
        if device_adapters < 1:
            raise SystemExit(f"--device-adapters {device_adapters}: need at least 1")
        self.capacity = device_adapters
        """Most adapters loaded into the model at once."""
        first = next(iter(adapters))
        base = load_model(model_dir, device, dtype)
        self.model = PeftModel.from_pretrained(base, adapters[first], adapter_name=first,
                                               autocast_adapter_dtype=False).eval()  # fmt: skip
        self.model.to(device)
        self.loaded: OrderedDict[str, None] = OrderedDict({first: None})
        """Adapters loaded into the model, least recently used first."""
        self.counters["loads"] = 1
        self._note_resident()

    def resident(self) -> list[str]:
        return list(self.loaded)

    def activate(self, variant: str) -> Any:
        if variant in self.loaded:
            self.loaded.move_to_end(variant)
        else:
            self.model.load_adapter(self.variants[variant], adapter_name=variant, autocast_adapter_dtype=False,
                                    torch_device=str(self.device))  # fmt: skip
            self.loaded[variant] = None
            self.counters["loads"] += 1
        self.model.set_adapter(variant)
        while len(self.loaded) > self.capacity:
            old = next(iter(self.loaded))
            del self.loaded[old]
            self.model.delete_adapter(old)
        return self.model


class SwapEngine(Engine):
    """``resident`` device slots holding whole models; a missing variant is read into the least
    recently used slot."""

    def __init__(self, models: dict[str, Path], device: Any, dtype: Any, max_batch: int, resident: int) -> None:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        super().__init__(models, device, max_batch)
        cfg = AutoConfig.from_pretrained(next(iter(models.values())))
        self.slots: list[Any] = []
        """Models of the variants' shared architecture on the device; their weights are overwritten on a swap."""
        for _ in range(min(resident, len(models))):
            with torch.device(device):
                self.slots.append(AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval())
        self.counters["slots"] = len(self.slots)
        self.holder: OrderedDict[str, int] = OrderedDict()
        """Variant → its slot, least recently used first."""

    def resident(self) -> list[str]:
        return list(self.holder)

    def activate(self, variant: str) -> Any:
        if variant in self.holder:
            self.holder.move_to_end(variant)
            return self.slots[self.holder[variant]]
        if len(self.holder) < len(self.slots):
            slot = len(self.holder)
        else:
            _, slot = self.holder.popitem(last=False)
        self._read_into(self.slots[slot], variant)
        self.holder[variant] = slot
        self.counters["loads"] += 1
        return self.slots[slot]

    def _read_into(self, model: Any, variant: str) -> None:
        """Copies every tensor of ``variant``'s safetensors files into ``model`` (straight to the device)."""
        from safetensors import safe_open

        params = dict(model.state_dict())
        missing = set(params)
        tied = {k for k in params if k == "lm_head.weight"} if model.config.tie_word_embeddings else set()
        for f in sorted(self.variants[variant].glob("*.safetensors")):
            with safe_open(str(f), framework="pt", device=str(self.device)) as st:
                for k in st.keys():
                    if k not in params:
                        raise ValueError(f"{f}: tensor {k!r} is not a parameter of the slot's architecture")
                    params[k].copy_(st.get_tensor(k))
                    missing.discard(k)
        missing -= tied
        if missing:
            raise ValueError(f"{self.variants[variant]}: no weights for {sorted(missing)[:5]}")


# ---------------------------------------------------------------------------------------------
# HTTP


@dataclass
class App:
    """The HTTP front of an :class:`Engine`."""

    engine: Engine
    """Where requests go."""
    tokenizer: Any = None
    """Turns token ids into chunk text (None: ``" <id>"``)."""

    async def handle(self, method: str, path: str, headers: dict, body: bytes, writer: asyncio.StreamWriter) -> None:
        if method == "GET" and path in ("/ready", "/health"):
            await http_sse.respond(writer, 200, b"ok", "text/plain")
        elif method == "GET" and path == "/stats":
            await http_sse.respond(writer, 200, json.dumps(self.engine.stats()).encode())
        elif method == "GET" and path == "/v1/models":
            data = [{"id": v, "object": "model", "owned_by": "baseline"} for v in self.engine.variants]
            await http_sse.respond(writer, 200, json.dumps({"object": "list", "data": data}).encode())
        elif method == "POST" and path == "/v1/completions":
            await self.completions(writer, body)
        else:
            await http_sse.respond(writer, 404, http_sse.error_body(f"no route {method} {path}", "not_found"))

    def _parse(self, body: bytes) -> tuple[dict, str | None]:
        """The request and None, or ({}, what is wrong with it)."""
        try:
            req = json.loads(body)
        except ValueError as e:
            return {}, f"body: not JSON ({e})"
        if not isinstance(req, dict):
            return {}, "body: want a JSON object"
        model, prompt, n = req.get("model"), req.get("prompt"), req.get("max_tokens", 16)
        if model not in self.engine.variants:
            return {}, f"model {model!r}: not served here; GET /v1/models lists the {len(self.engine.variants)} models"
        if not (isinstance(prompt, list) and prompt and all(isinstance(t, int) and t >= 0 for t in prompt)):
            return {}, "prompt: the baselines take a non-empty list of token ids"
        if not (isinstance(n, int) and n >= 1):
            return {}, f"max_tokens {n!r}: want an integer >= 1"
        if req.get("temperature", 0) not in (0, 0.0, None):
            return {}, f"temperature {req['temperature']!r}: the baselines decode greedily (temperature 0)"
        return req, None

    async def completions(self, writer: asyncio.StreamWriter, body: bytes) -> None:
        req, err = self._parse(body)
        if err is not None:
            status = 404 if err.startswith("model") else 400
            kind = "not_found_error" if status == 404 else "invalid_request_error"
            return await http_sse.respond(writer, status, http_sse.error_body(err, kind))
        model, n, prompt = req["model"], req.get("max_tokens", 16), req["prompt"]
        q: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self.engine.submit(Pending(model, prompt, n, time.monotonic(),
                                   lambda item: loop.call_soon_threadsafe(q.put_nowait, item)))  # fmt: skip
        cid = f"cmpl-{id(q):x}"
        tokens: list[int] = []
        if not req.get("stream"):
            while (item := await q.get()) is not None:
                if isinstance(item, Exception):
                    return await http_sse.respond(writer, 500, http_sse.error_body(str(item), "internal_error"))
                tokens.append(item)
            out = http_sse.chunk(model, "".join(self._text(t) for t in tokens), "length", cid)
            out["choices"][0]["token_ids"] = tokens
            out["usage"] = http_sse.usage(len(prompt), len(tokens))
            return await http_sse.respond(writer, 200, json.dumps(out).encode())
        writer.write(http_sse.SSE_HEAD)
        await writer.drain()
        while (item := await q.get()) is not None:
            if isinstance(item, Exception):
                http_sse.write_event(writer, json.loads(http_sse.error_body(str(item), "internal_error")))
                http_sse.end_stream(writer, done=False)
                return await writer.drain()
            tokens.append(item)
            ev = http_sse.chunk(model, self._text(item), None, cid)
            ev["choices"][0]["token_ids"] = [item]
            http_sse.write_event(writer, ev)
            await writer.drain()
        http_sse.write_event(writer, http_sse.chunk(model, "", "length", cid))
        if (req.get("stream_options") or {}).get("include_usage"):
            http_sse.write_event(writer, {**http_sse.chunk(model, "", None, cid), "choices": [],
                                          "usage": http_sse.usage(len(prompt), len(tokens))})  # fmt: skip
        http_sse.end_stream(writer)
        await writer.drain()

    def _text(self, token: int) -> str:
        if self.tokenizer is None:
            return f" <{token}>"
        return self.tokenizer.decode([token])


def serve(engine: Engine, tokenizer: Any, host: str, port: int) -> None:
    """Runs the engine thread and the HTTP server until killed; listening means ready."""
    threading.Thread(target=engine.run, name="engine", daemon=True).start()
    app = App(engine, tokenizer)

    async def main() -> None:
        server = await asyncio.start_server(lambda r, w: http_sse.serve_connection(r, w, app.handle), host, port,
                                            backlog=4096)  # fmt: skip
        print(f"baseline {type(engine).__name__} listening on http://{host}:{port} "
              f"({len(engine.variants)} variants, device {engine.device})", flush=True)  # fmt: skip
        async with server:
            await server.serve_forever()

    asyncio.run(main())


def _tokenizer(model_dir: Path | None) -> Any:
    if model_dir is None or not (model_dir / "tokenizer.json").is_file():
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Baseline servers (see the module docstring).")
    p.add_argument("kind", choices=BASELINES)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--devices", default="cpu", help="`cpu` or one CUDA id")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "float16", "bfloat16"))
    p.add_argument("--max-batch", type=int, default=32, help="most requests of one variant in a batch")
    p.add_argument("--model", type=Path, help="peft: the base model directory")
    p.add_argument("--lora-dir", type=Path, help="peft: a directory of PEFT adapter directories")
    p.add_argument("--device-adapters", type=int, default=8, help="peft: most adapters loaded on the device")
    p.add_argument("--models-dir", type=Path, help="swap: a directory of full-model HF directories")
    p.add_argument(
        "--resident",
        default="1",
        help="swap: most full models on the device at once, or 'auto': as many as fit beside one batch",
    )
    p.add_argument(
        "--max-seq",
        type=int,
        default=1024,
        help="swap, --resident auto: prompt + output tokens one sequence of a batch is sized for",
    )
    a = p.parse_args(argv)
    if a.max_batch < 1:
        p.error(f"--max-batch {a.max_batch}: need at least 1")
    device = torch_device(a.devices)
    if a.kind == "peft":
        if a.model is None or a.lora_dir is None:
            p.error("peft needs --model and --lora-dir")
        engine: Engine = PeftEngine(a.model, adapter_dirs(a.lora_dir), device, model_dtype(a.model, device, a.dtype),
                                    a.max_batch, a.device_adapters)  # fmt: skip
        tok_dir = a.model
    else:
        if a.models_dir is None:
            p.error("swap needs --models-dir")
        models = model_dirs(a.models_dir)
        first = next(iter(models.values()))
        dtype = model_dtype(first, device, a.dtype)
        slots = resident_slots(a.resident, models, device, dtype, a.max_batch, a.max_seq)
        engine = SwapEngine(models, device, dtype, a.max_batch, slots)
        tok_dir = first
    serve(engine, _tokenizer(tok_dir), a.host, a.port)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
