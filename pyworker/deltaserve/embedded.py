"""What ``deltaserve.Server`` and ``deltaserve.LLM`` share: keyword arguments turned into the
daemon's command-line flags (the daemon's config struct stays the one owner of every flag, so a
new flag needs no change here), and the start and stop of the router in this process
(``_native.EmbeddedServer``), stopped at the latest when its owner goes away or at interpreter
exit.
"""

from __future__ import annotations

import os
import sys
import weakref
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from deltaserve._native import EmbeddedServer


def flags_from(**options: Any) -> list[str]:
    """Command-line flags of ``options``: ``max_num_seqs=8`` -> ``--max-num-seqs 8``; ``None``
    is left out; booleans are ``true``/``false``; a mapping (``loras={"sql": path}``) gives one
    ``--lora NAME=PATH`` per entry, a list or tuple one flag per item, except ``devices``, which
    is one comma-separated value. ``loras``, ``deltas`` and ``zoos`` are the plural spellings of
    ``--lora``, ``--delta`` and ``--zoo``."""
    singular = {"loras": "lora", "deltas": "delta", "lora_dirs": "lora_dir", "zoos": "zoo"}
    out: list[str] = []
    for key, value in options.items():
        if value is None:
            continue
        flag = "--" + singular.get(key, key).replace("_", "-")
        if key == "devices" and not isinstance(value, str | int):
            value = ",".join(str(d) for d in value)
        if isinstance(value, Mapping):
            items: Iterable[Any] = (f"{name}={os.fspath(path)}" for name, path in value.items())
        elif isinstance(value, list | tuple):
            items = value
        else:
            items = [value]
        for item in items:
            if isinstance(item, bool):
                item = "true" if item else "false"
            elif isinstance(item, os.PathLike):
                item = os.fspath(item)
            out += [flag, str(item)]
    return out


def start(flags: list[str], http: bool, owner: object) -> EmbeddedServer:
    """Starts the router in this process with ``flags`` (workers run under this interpreter
    unless ``--python`` is given). It is stopped when ``owner`` (the ``Server`` or ``LLM``) is
    garbage-collected or at interpreter exit, whichever comes first, if not stopped before."""
    from deltaserve._native import EmbeddedServer

    server = EmbeddedServer(flags, sys.executable, http)
    weakref.finalize(owner, server.stop)
    return server
