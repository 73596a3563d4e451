"""The servers an experiment runs against, by ``--server`` name (:data:`SERVERS`), and the flags
each one gets.

    deltaserve  the daemon (bench/launch.py ``deltaserve_server``)
    fake        bench/fake_server.py in this process: a dry run of the driver
    peft, swap  bench/baselines.py, run as its own process (``python -m bench.baselines KIND``):
                this module knows its command line and imports nothing from it
    merged      the daemon serving one adapter merged into the base (peft ``merge_and_unload``)
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from bench.common import RANDOM_WEIGHTS_FILE, adapter_dirs, checkpoint_dtype
from bench.launch import (
    Endpoint,
    ServerSpec,
    bench_env,
    deltaserve_server,
    demo_model_dir,
    free_port,
    launch,
    module_command,
)


@contextlib.contextmanager
def fake_server(spec: ServerSpec) -> Iterator[Endpoint]:
    """bench/fake_server.py (10 ms to the first token, 1 ms per token): a dry run of the driver."""
    from bench.fake_server import FakeServer

    with FakeServer(ttft=0.01, tpot=0.001) as s:
        yield Endpoint(s.url, s.ws_url)


def pop_option(flags: list[str], name: str) -> tuple[str | None, list[str]]:
    """The value of ``name=V`` / ``name V`` in ``flags`` and the flags without it."""
    rest, value, i = [], None, 0
    while i < len(flags):
        f = flags[i]
        if f.startswith(name + "="):
            value = f.split("=", 1)[1]
        elif f == name and i + 1 < len(flags):
            value, i = flags[i + 1], i + 1
        else:
            rest.append(f)
        i += 1
    return value, rest


@contextlib.contextmanager
def baseline_server(kind: str, spec: ServerSpec, args: list[str]) -> Iterator[Endpoint]:
    """``python -m bench.baselines KIND`` on a free port with ``args``, then ``spec.flags``."""
    port = free_port()
    cmd = module_command("bench.baselines", kind, "--port", str(port), "--devices", spec.devices, *args, *spec.flags)
    with launch(cmd, f"http://127.0.0.1:{port}", spec.log, env=bench_env()) as url:
        yield Endpoint(url)


@contextlib.contextmanager
def peft_server(spec: ServerSpec) -> Iterator[Endpoint]:
    """``--server peft``: the PEFT baseline on ``spec.model_dir`` (the demo model when None) with
    every adapter of ``spec.lora_dir``; ``spec.flags`` go to bench/baselines.py (``--max-batch``,
    ``--device-adapters``)."""
    model = spec.model_dir or demo_model_dir()
    with baseline_server("peft", spec, ["--model", str(model), "--lora-dir", str(spec.lora_dir)]) as ep:
        yield ep


@contextlib.contextmanager
def swap_server(spec: ServerSpec) -> Iterator[Endpoint]:
    """``--server swap``: whole-model swapping over the full-model directories under
    ``spec.lora_dir`` (one per variant, named like it); ``--resident K|auto`` in ``spec.flags``."""
    with baseline_server("swap", spec, ["--models-dir", str(spec.lora_dir)]) as ep:
        yield ep


def merge_lora(model_dir: Path, adapter_dir: Path, out: Path) -> Path:
    """``out``: the base with the adapter merged in (peft ``merge_and_unload``), an HF directory
    with the base's tokenizer files; float32 on the CPU, saved in the base's dtype."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
    merged.to(checkpoint_dtype(model_dir)).save_pretrained(out, safe_serialization=True)
    for f in model_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation_config", "vocab", "merges")) and f.is_file():
            shutil.copy(f, out / f.name)
    return out


@contextlib.contextmanager
def merged_server(spec: ServerSpec) -> Iterator[Endpoint]:
    """``--server merged``: the deltaserve daemon serving one variant merged into the base, every
    request's model mapped to it. The variant is ``--merge=NAME`` in ``spec.flags`` (default: the
    first adapter of ``spec.lora_dir``). A random-weights base (bench/common.py) is served as it
    is: merging changes weight values, not the work, so the base's cost is the merged variant's."""
    name, flags = pop_option(list(spec.flags), "--merge")
    adapters = adapter_dirs(spec.lora_dir)
    name = name or next(iter(adapters))
    if name not in adapters:
        raise SystemExit(f"--merge={name}: no such adapter in {spec.lora_dir}")
    model = spec.model_dir or demo_model_dir()
    with tempfile.TemporaryDirectory(prefix="deltaserve-merged-") as tmp:
        tmp = Path(tmp)
        if (model / RANDOM_WEIGHTS_FILE).is_file():
            served = model
        else:
            served = merge_lora(model, adapters[name], tmp / f"merged-{name}")
        (tmp / "no-adapters").mkdir()
        inner = ServerSpec(model_dir=served, lora_dir=tmp / "no-adapters", devices=spec.devices,
                           flags=[*flags, "--served-model-name", "merged"], daemon=spec.daemon, log=spec.log)  # fmt: skip
        with deltaserve_server(inner) as ep:
            yield Endpoint(ep.url, ep.ws_url, model="merged")


SERVERS: dict[str, Callable[[ServerSpec], contextlib.AbstractContextManager[Endpoint]]] = {
    "deltaserve": deltaserve_server,
    "fake": fake_server,
    "peft": peft_server,
    "swap": swap_server,
    "merged": merged_server,
}
"""Server launchers by ``--server`` name: each yields the :class:`Endpoint` of a ready server
speaking /v1/completions (SSE) and, for ws points, /v1/ws. The baselines (bench/baselines.py)
speak SSE only."""


def merge_flags(defaults: tuple[str, ...] | list[str], extra: list[str]) -> list[str]:
    """``defaults`` less every flag that ``extra`` sets (``--f=V`` or ``--f V``), then ``extra``:
    a ``--server-flag`` replaces an experiment's value instead of repeating the flag (which the
    daemon refuses)."""
    given = {f.split("=", 1)[0] for f in extra if f.startswith("--")}
    out: list[str] = []
    keep = True
    for f in defaults:
        if f.startswith("--"):
            keep = f.split("=", 1)[0] not in given
        if keep:
            out.append(f)
    return out + list(extra)


def flags_for(server: str, flags: list[str]) -> list[str]:
    """The ``--server-flag``s for ``server``: those without a prefix and those written
    ``SERVER:FLAG`` for it (prefix removed)."""
    out = []
    for f in flags:
        prefix, sep, rest = f.partition(":")
        if sep and prefix in SERVERS:
            if prefix == server:
                out.append(rest)
        else:
            out.append(f)
    return out
