"""The HTTP share of a request's TTFT: what a client sees minus what the router's clock says.

The router's TTFT histogram (``deltaserve_time_to_first_token_seconds``) runs from the request's
queue to its first token; a client also pays the HTTP trip: its own request and response handling,
the connection, the daemon's HTTP layer and JSON. ``bench.prefix_caching`` measures TTFT with
urllib (a new connection per request, a non-streamed body, ``max_tokens: 1``), so the trip is in
both its hit and its miss. This script serves one prompt repeatedly (prefix-cache hits after the
first) and, per client form, sets the client's mean against the router's mean over the same
requests (``/metrics`` before and after):

    urllib          a new connection per request, the completion's JSON body (prefix_caching's form)
    keep-alive      one http.client connection kept open, the same body
    stream          one kept-alive connection, ``stream: true``: the time to the first SSE event

    python3 -m bench.http_trip [--devices cpu] [--demo] [--prompt-tokens 200] [--requests 20] [--out DIR]
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from bench import script_env

script_env.prepare()

from bench.common import write_random_served_model, write_result  # noqa: E402
from bench.launch import Endpoint, ServerSpec, deltaserve_server, demo_model_dir  # noqa: E402
from bench.prefix_caching import TTFT_HISTOGRAM, complete  # noqa: E402
from bench.serving.runner import server_metrics  # noqa: E402

FORMS = ("urllib", "keep-alive", "stream")


def trip_row(form: str, client_s: list[float], before: dict, after: dict) -> dict:
    """One form's row: the client's and the router's mean TTFT (ms) over the same requests, and the
    trip between them."""
    ttft_sum, ttft_n = (after[k] - before[k] for k in TTFT_HISTOGRAM)
    client_ms = statistics.fmean(client_s) * 1e3
    router_ms = ttft_sum / ttft_n * 1e3
    return {
        "form": form,
        "requests": len(client_s),
        "client_ttft_ms": client_ms,
        "router_ttft_ms": router_ms,
        "trip_ms": client_ms - router_ms,
    }


def timers(url: str, model: str, prompt: list[int]) -> dict[str, Callable[[], float]]:
    """Per form, a function that sends one ``max_tokens: 1`` request and returns the client's TTFT (s)."""
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=600)
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True}
    plain, streamed = json.dumps(body), json.dumps({**body, "stream": True})
    headers = {"content-type": "application/json"}

    def kept() -> float:
        t0 = time.perf_counter()
        conn.request("POST", "/v1/completions", plain, headers)
        json.loads(conn.getresponse().read())
        return time.perf_counter() - t0

    def stream() -> float:
        t0 = time.perf_counter()
        conn.request("POST", "/v1/completions", streamed, headers)
        r = conn.getresponse()
        while not r.readline().startswith(b"data:"):
            pass
        first = time.perf_counter() - t0
        r.read()  # the rest of the stream, so the connection is free again
        return first

    return {"urllib": lambda: complete(url, model, prompt, 1)[0], "keep-alive": kept, "stream": stream}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", default="cpu", help="CUDA ids, or cpu")
    ap.add_argument("--shape", default="llama-2-7b", help="random-weight model shape, without --demo")
    ap.add_argument("--demo", action="store_true", help="serve the bundled demo model")
    ap.add_argument("--prompt-tokens", type=int, default=200)
    ap.add_argument("--requests", type=int, default=20, help="timed requests per form")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.devices == "cpu" and not args.demo:
        ap.error("--devices cpu needs --demo (a random 7B model is too slow on the CPU)")
    rows = []
    with tempfile.TemporaryDirectory() as tmp_name:
        model_dir = demo_model_dir() if args.demo else write_random_served_model(args.shape, Path(tmp_name) / "m")
        spec = ServerSpec(model_dir, None, args.devices, flags=["--enable-prefix-caching"],
                          log=Path(tmp_name) / "daemon.log")  # fmt: skip
        with deltaserve_server(spec) as ep:
            model = json.loads(urllib.request.urlopen(f"{ep.url}/v1/models").read())["data"][0]["id"]
            prompt = [3 + (i * 104729) % 30000 for i in range(args.prompt_tokens)]
            send = timers(ep.url, model, prompt)
            for form in FORMS:  # warm-up: the prompt's pages cached, each form's path once
                send[form]()
            for form in FORMS:
                before = server_metrics(Endpoint(ep.url))
                client_s = [send[form]() for _ in range(args.requests)]
                rows.append(trip_row(form, client_s, before, server_metrics(Endpoint(ep.url))))
                r = rows[-1]
                print(f"{form:>10}: client {r['client_ttft_ms']:7.2f} ms, router {r['router_ttft_ms']:7.2f} ms, "
                      f"trip {r['trip_ms']:5.2f} ms", flush=True)  # fmt: skip
    device = "cpu"
    if args.devices != "cpu":
        import torch

        device = torch.cuda.get_device_name(int(args.devices.split(",")[0]))
    model_name = model_dir.name if args.demo else args.shape
    payload = {"device": device, "model": model_name, "prompt_tokens": args.prompt_tokens, "rows": rows}
    print(write_result("http_trip", payload, args.out))


if __name__ == "__main__":
    main()
