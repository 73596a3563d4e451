"""``deltaserve.Server``: the router in this process, serving the HTTP API.

.. code-block:: python

    with deltaserve.Server(model="path/to/model", loras={"sql": "path/to/adapter"}, port=0) as srv:
        openai.OpenAI(base_url=srv.url + "/v1", api_key="-").completions.create(...)
        srv.register("ft", "path/to/delta")      # the engine's admin path, no HTTP
        srv.metrics()["deltaserve_requests_finished_total"]

Its tokio runtime runs on Rust threads without the GIL; the workers are child processes, as
under the daemon. Stopping (``stop()``, leaving the ``with`` block, ``KeyboardInterrupt`` or
interpreter exit) waits until every worker has exited.
"""

from __future__ import annotations

import json
import os
from types import TracebackType
from typing import Any

from deltaserve.embedded import flags_from, start


class Server:
    """The daemon, in this process: ``Server(model, loras=..., deltas=..., devices=..., **flags)``.

    Args:
        model: HF model directory (``None``: the bundled demo model and its demo adapters).
        loras: LoRA adapters to serve, ``{name: PEFT directory}``.
        deltas: compressed deltas to serve, ``{name: directory written by deltaserve compress}``.
        devices: ``"cpu"`` or CUDA device ids (``"0"``, ``"0,1"``, ``[0, 1]``): one worker each.
        host: address to listen on.
        port: port to listen on; 0 (the default) picks a free one (see ``url``).
        **flags: any other flag of ``deltaserve --help``, in Python spelling
            (``max_num_seqs=8``, ``overlap_steps=False``, ``lora_dirs=[...]``).

    Raises ``ValueError`` for a flag the daemon does not take, ``RuntimeError`` when the server
    cannot start (its message says why).
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | None = None,
        *,
        loras: dict[str, str | os.PathLike[str]] | None = None,
        deltas: dict[str, str | os.PathLike[str]] | None = None,
        devices: str | int | list[int] | list[str] = "cpu",
        host: str = "127.0.0.1",
        port: int = 0,
        **flags: Any,
    ) -> None:
        args = flags_from(model=model, loras=loras, deltas=deltas, devices=devices, host=host, port=port, **flags)
        self._server = start(args, http=True, owner=self)

    @property
    def url(self) -> str:
        """``http://host:port`` of the API (the port actually bound)."""
        url = self._server.url
        assert url is not None, "started with http"
        return url

    @property
    def running(self) -> bool:
        """Whether the server runs (``stop()`` not called yet)."""
        return self._server.running

    def register(self, name: str, path: str | os.PathLike[str], kind: str | None = None) -> dict[str, Any]:
        """Serves the variant in ``path`` as ``name`` (``kind``: ``"lora"``, ``"delta"`` or
        ``None`` to tell from the directory) and returns its registry entry; as
        ``POST /v1/adapters``, without HTTP. Raises ``ValueError`` when it cannot be served as
        given (bad name or directory, name taken), and nothing changes."""
        return json.loads(self._server.register(name, os.fspath(path), kind))

    def unregister(self, name: str) -> dict[str, Any]:
        """Stops serving the variant ``name`` (its memory is freed once no request uses it) and
        returns its last registry entry; as ``DELETE /v1/adapters/{name}``."""
        return json.loads(self._server.unregister(name))

    def metrics_text(self) -> str:
        """The engine's metrics in the Prometheus text format."""
        return self._server.metrics_text()

    def metrics(self) -> dict[str, float]:
        """The engine's metrics as ``{sample name with labels: value}``, e.g.
        ``deltaserve_requests_finished_total`` or ``deltaserve_e2e_request_latency_seconds_count``."""
        return parse_prometheus(self.metrics_text())

    def stop(self) -> None:
        """Stops the API and the workers, waiting until every worker has exited; idempotent."""
        self._server.stop()

    def __enter__(self) -> Server:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"Server({self._server.url!r}, running={self.running})"


def parse_prometheus(text: str) -> dict[str, float]:
    """``{name{labels}: value}`` of the samples of a Prometheus text exposition."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        out[name] = float(value)
    return out
