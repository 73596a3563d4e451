"""A minimal command-line client for a running deltaserve daemon (standard library only).

    python -m deltaserve.client --url http://127.0.0.1:8000 --wait 600 chat "What is the capital of France?"
    python -m deltaserve.client complete "Once upon a time" --max-tokens 32

``--url`` defaults to ``$DELTASERVE_URL``, else ``http://127.0.0.1:8000``. ``--wait`` polls
``GET /ready`` first, so a script can start the daemon and call this at once. Answers are streamed
(server-sent events) and printed as they arrive; when no daemon answers, one line says so.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator


def wait_ready(url: str, timeout_s: float) -> None:
    """Polls ``GET /ready`` until it answers 200, or raises ``TimeoutError``."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/ready", timeout=5) as r:
                if r.status == 200:
                    return
        except urllib.error.HTTPError as e:
            last = f"HTTP {e.code}"
        except OSError as e:
            last = str(e)
        time.sleep(0.5)
    raise TimeoutError(f"{url} was not ready within {timeout_s:.0f} s ({last})")


def stream_events(url: str, path: str, body: dict) -> Iterator[dict]:
    """POSTs ``body`` with ``stream: true`` and yields each SSE ``data:`` JSON object."""
    req = urllib.request.Request(
        f"{url}{path}",
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        resp = urllib.request.urlopen(req, timeout=600)
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"HTTP {e.code}: {e.read().decode(errors='replace')}") from None
    with resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[len("data:") :].strip()
            if data == "[DONE]":
                return
            event = json.loads(data)
            if "error" in event:
                raise RuntimeError(event["error"].get("message", str(event)))
            yield event


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deltaserve.client", description=__doc__.splitlines()[0])
    p.add_argument("--url", default=os.environ.get("DELTASERVE_URL", "http://127.0.0.1:8000"),
                   help="daemon base URL [env DELTASERVE_URL; default http://127.0.0.1:8000]")  # fmt: skip
    p.add_argument("--wait", type=float, default=0, help="seconds to wait for /ready first")
    p.add_argument("--model", default=None, help="model name (default: the first one served)")
    sub = p.add_subparsers(dest="cmd", required=True)
    chat = sub.add_parser("chat", help="one chat turn")
    chat.add_argument("message")
    comp = sub.add_parser("complete", help="a plain completion")
    comp.add_argument("prompt")
    for s in (chat, comp):
        s.add_argument("--max-tokens", type=int, default=64)
        s.add_argument("--temperature", type=float, default=0.0)
    args = p.parse_args(argv)
    try:
        return _run(args)
    except (TimeoutError, urllib.error.URLError, ConnectionError) as e:  # one line, not a traceback
        reason = getattr(e, "reason", e)
        print(f"error: no deltaserve daemon answers at {args.url} ({reason}); start one with "
              f"`make serve` or `.venv/bin/deltaserve`, or pass --url", file=sys.stderr)  # fmt: skip
        return 1


def _run(args: argparse.Namespace) -> int:
    if args.wait:
        wait_ready(args.url, args.wait)
    model = args.model
    if model is None:
        with urllib.request.urlopen(f"{args.url}/v1/models", timeout=30) as r:
            model = json.load(r)["data"][0]["id"]
    common = {"model": model, "max_tokens": args.max_tokens, "temperature": args.temperature}
    try:
        if args.cmd == "chat":
            print(f"[{model}] user: {args.message}\n[{model}] assistant: ", end="", flush=True)
            body = {**common, "messages": [{"role": "user", "content": args.message}]}
            for ev in stream_events(args.url, "/v1/chat/completions", body):
                for choice in ev.get("choices", []):
                    print(choice.get("delta", {}).get("content") or "", end="", flush=True)
        else:
            print(args.prompt, end="", flush=True)
            for ev in stream_events(args.url, "/v1/completions", {**common, "prompt": args.prompt}):
                for choice in ev.get("choices", []):
                    print(choice.get("text") or "", end="", flush=True)
    except RuntimeError as e:
        print(f"\nerror: {e}", file=sys.stderr)
        return 1
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
