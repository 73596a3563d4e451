"""deltaserve: serve many fine-tuned variants of one base LLM in one batch (base + delta).

Python side of the system. Layout (the data flow, in order):

- ``wire``       generated mirror of the Rust ``ipc`` crate's schema (never edit by hand)
- ``_native``    private Rust extension: the shared-memory ring the worker talks through
- ``worker``     the worker process: IPC loop, executor (StepPlan -> forward -> StepOutput)
- ``model``      one generic decoder for the Llama family, its loader and the paged KV cache
- ``demo_model`` converts the bundled SmolLM2-135M-Instruct GGUF into an HF directory, once
- ``client``     ``Client`` / ``AsyncClient``: typed clients of a running server's HTTP and WebSocket APIs
- ``server``     ``Server``: the router (HTTP API, workers) inside this process
- ``llm``        ``LLM`` and ``SamplingParams``: offline generation straight into the engine
- ``cli``        the ``deltaserve`` console script: the Rust daemon's command line

The public names below are imported on first use, so the worker's ``import deltaserve`` stays light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what type checkers see; at run time, __getattr__ below
    from .client import AsyncClient as AsyncClient
    from .client import Client as Client
    from .llm import LLM as LLM
    from .sampling_params import SamplingParams as SamplingParams
    from .server import Server as Server

__version__ = "0.1.0"

# Public name -> the module that defines it (imported when the name is first used).
_LAZY = {
    "Client": "deltaserve.client",
    "AsyncClient": "deltaserve.client",
    "Server": "deltaserve.server",
    "LLM": "deltaserve.llm",
    "SamplingParams": "deltaserve.sampling_params",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'deltaserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
