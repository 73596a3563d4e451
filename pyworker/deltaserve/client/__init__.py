"""Clients of a running deltaserve server (the daemon, or ``deltaserve.Server``): typed results
over its OpenAI-compatible HTTP API, token streams over its WebSocket (or SSE), variant admin,
models, metrics and health.

```python
from deltaserve.client import Client

with Client("http://127.0.0.1:8000") as c:          # default: $DELTASERVE_URL, else :8000
    print(c.chat("Name three colors.", temperature=0, max_tokens=16).text)
    for event in c.stream_completions("Once upon a time", max_tokens=16):
        print(event.text, end="")
```

Layout (what a request passes through, in order):

- ``sync``           ``Client`` and its ``TokenStream`` (blocking)
- ``aio``            ``AsyncClient``, ``AsyncTokenStream``, and ``run`` (asyncio, on uvloop if installed)
- ``protocol``       request bodies, response / SSE / WebSocket JSON → results (no I/O)
- ``transport``      blocking HTTP (``http.client``) and WebSocket (``websockets.sync``)
- ``aio_transport``  HTTP/1.1 on asyncio streams, one shared WebSocket per ``AsyncClient``
- ``types``          ``Completion``, ``TokenEvent``, ``Model``, ``Variant``, ``APIError``, ...
- ``metrics``        Prometheus text → ``{"name{labels}": value}``
- ``__main__``       ``python -m deltaserve.client chat|complete``: a thin user of ``Client``

HTTP needs only the standard library; WebSocket streams need ``pip install 'deltaserve[client]'``.
"""

from .aio import AsyncClient, AsyncTokenStream, run
from .metrics import parse_metrics
from .sync import Client, TokenStream
from .types import (
    APIConnectionError,
    APIError,
    APITimeoutError,
    Completion,
    Model,
    TokenEvent,
    TokenLogprob,
    TopLogprob,
    Usage,
    Variant,
)

__all__ = [
    "APIConnectionError",
    "APIError",
    "APITimeoutError",
    "AsyncClient",
    "AsyncTokenStream",
    "Client",
    "Completion",
    "Model",
    "TokenEvent",
    "TokenLogprob",
    "TokenStream",
    "TopLogprob",
    "Usage",
    "Variant",
    "parse_metrics",
    "run",
]
