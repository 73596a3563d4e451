"""A small WebSocket client for the daemon's ``/v1/ws`` endpoint (test helper)."""

from __future__ import annotations

import asyncio
import json

import websockets


async def ws_generate_many(url: str, requests: dict[str, dict], timeout_s: float = 120) -> dict[str, dict]:
    """Runs every request concurrently on ONE socket; returns per id its token ids, text and done event."""
    ws_url = url.replace("http://", "ws://") + "/v1/ws"
    results = {rid: {"token_ids": [], "text": "", "done": None, "error": None} for rid in requests}
    async with websockets.connect(ws_url, max_size=None) as ws:
        for rid, body in requests.items():
            await ws.send(json.dumps({"type": "generate", "id": rid, "request": body}))
        pending = set(requests)
        async with asyncio.timeout(timeout_s):
            while pending:
                msg = json.loads(await ws.recv())
                rid = msg.get("id")
                if msg["type"] == "token":
                    results[rid]["token_ids"].append(msg["token_id"])
                    results[rid]["text"] += msg["text"]
                elif msg["type"] == "done":
                    results[rid]["done"] = msg
                    pending.discard(rid)
                elif msg["type"] == "error":
                    if rid is None:
                        raise AssertionError(f"socket-level error: {msg}")
                    results[rid]["error"] = msg
                    pending.discard(rid)
    return results


def ws_generate(url: str, requests: dict[str, dict], timeout_s: float = 120) -> dict[str, dict]:
    return asyncio.run(ws_generate_many(url, requests, timeout_s))
