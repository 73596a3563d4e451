"""A minimal command-line client for a running deltaserve daemon (standard library only).

    python -m deltaserve.client --url http://127.0.0.1:8000 --wait 600 chat "What is the capital of France?"
    python -m deltaserve.client complete "Once upon a time" --max-tokens 32

``--url`` defaults to ``$DELTASERVE_URL``, else ``http://127.0.0.1:8000``. ``--wait`` polls
``GET /ready`` first, so a script can start the daemon and call this at once. Answers are streamed
(server-sent events) and printed as they arrive; when no daemon answers, one line says so.
"""

from __future__ import annotations

import argparse
import os
import sys

from .protocol import DEFAULT_URL
from .sync import Client
from .types import APIConnectionError, APIError, APITimeoutError


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deltaserve.client", description=(__doc__ or "").splitlines()[0])
    p.add_argument("--url", default=os.environ.get("DELTASERVE_URL", DEFAULT_URL),
                   help=f"daemon base URL [env DELTASERVE_URL; default {DEFAULT_URL}]")  # fmt: skip
    p.add_argument("--api-key", default=None, help="sent as `Authorization: Bearer` [env DELTASERVE_API_KEY]")
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
        client = Client(args.url, api_key=args.api_key, transport="sse")
    except ValueError as e:
        p.error(str(e))
    with client:
        try:
            return run(client, args)
        except (APIConnectionError, APITimeoutError) as e:  # one line, not a traceback
            reason = e.reason if isinstance(e, APIConnectionError) else e.message
            print(f"error: no deltaserve daemon answers at {args.url} ({reason}); start one with "
                  f"`make serve` or `.venv/bin/deltaserve`, or pass --url", file=sys.stderr)  # fmt: skip
            return 1


def run(client: Client, args: argparse.Namespace) -> int:
    """Runs the command; an API error mid-way prints one line and returns 1."""
    if args.wait:
        client.wait_ready(args.wait)
    try:
        model = args.model or client.models()[0].id
        if args.cmd == "chat":
            print(f"[{model}] user: {args.message}\n[{model}] assistant: ", end="", flush=True)
            stream = client.stream_chat(
                args.message, model=model, max_tokens=args.max_tokens, temperature=args.temperature
            )
        else:
            print(args.prompt, end="", flush=True)
            stream = client.stream_completions(
                args.prompt, model=model, max_tokens=args.max_tokens, temperature=args.temperature
            )
        with stream:
            for event in stream:
                print(event.text, end="", flush=True)
    except APIConnectionError:
        raise
    except APIError as e:
        print(f"\nerror: {e}", file=sys.stderr)
        return 1
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
