"""The client's parts that need no daemon: the Prometheus parser, error bodies, URL checks, the
missing-``websockets`` message, ``run`` picking uvloop's loop only when uvloop is installed, and
kept-alive connections the server closed being replaced (against a stand-in HTTP server)."""

from __future__ import annotations

import asyncio
import importlib
import json
import math
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from deltaserve.client import APIError, AsyncClient, Client, parse_metrics, run
from deltaserve.client.metrics import metric_key
from deltaserve.client.protocol import error_from_body

PROMETHEUS = """\
# HELP deltaserve_steps_total Engine steps run.
# TYPE deltaserve_steps_total counter
deltaserve_steps_total 9
deltaserve_api_errors_total{type="not_found_error"} 2
ttft_bucket{le="+Inf"} 3
ttft_bucket{le="0.5"} 1 1700000000000
odd{ a = "x y" , b="q\\"u\\\\o\\nte",} NaN
neg -Inf
"""


def test_prometheus_text_parses_into_name_and_labels_keys():
    m = parse_metrics(PROMETHEUS)
    assert m["deltaserve_steps_total"] == 9
    assert m['deltaserve_api_errors_total{type="not_found_error"}'] == 2
    assert m['ttft_bucket{le="+Inf"}'] == 3 and m['ttft_bucket{le="0.5"}'] == 1  # timestamp dropped
    key = metric_key("odd", {"a": "x y", "b": 'q"u\\o\nte'})
    assert key == 'odd{a="x y",b="q\\"u\\\\o\\nte"}' and math.isnan(m[key])
    assert m["neg"] == -math.inf and len(m) == 6
    with pytest.raises(ValueError, match="line 2"):
        parse_metrics("ok 1\nbroken{a=1} 2\n")
    with pytest.raises(ValueError, match="line 1"):
        parse_metrics("no_value\n")


def test_error_bodies_and_urls():
    e = error_from_body(404, b'{"error": {"message": "m", "type": "not_found_error", "param": "model", "code": "c"}}')
    assert (e.status, e.type, e.message, e.param, e.code) == (404, "not_found_error", "m", "model", "c")
    e = error_from_body(502, b"<html>bad gateway</html>")  # not ours: a proxy's
    assert (e.status, e.type, e.message) == (502, "http_error", "<html>bad gateway</html>")
    assert isinstance(e, APIError) and str(e) == "502 http_error: <html>bad gateway</html>"
    for bad in ("localhost:8000", "ftp://x", "http://x:1/?q=1"):
        with pytest.raises(ValueError, match="server URL"):
            Client(bad)
    assert Client("http://h:1/prefix/").url == "http://h:1/prefix"
    with pytest.raises(ValueError, match="transport"):
        Client("http://h:1", transport="grpc")  # type: ignore[arg-type]


def test_url_and_key_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("DELTASERVE_URL", "http://example.test:9")
    monkeypatch.setenv("DELTASERVE_API_KEY", "k1")
    c = Client()
    assert c.url == "http://example.test:9" and c.headers == {"Authorization": "Bearer k1"}
    monkeypatch.delenv("DELTASERVE_URL")
    monkeypatch.delenv("DELTASERVE_API_KEY")
    assert Client().url == "http://127.0.0.1:8000" and Client().headers == {}


def test_websocket_streams_without_websockets_say_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "websockets", None)  # makes `import websockets...` fail
    monkeypatch.setitem(sys.modules, "websockets.sync.client", None)
    with pytest.raises(ImportError, match=r"pip install 'deltaserve\[client\]'"):
        next(Client("http://127.0.0.1:1", transport="ws").stream_completions("x"))


def test_run_uses_uvloop_only_when_installed(monkeypatch):
    async def loop_module() -> str:
        return type(asyncio.get_running_loop()).__module__

    has_uvloop = importlib.util.find_spec("uvloop") is not None
    assert run(loop_module()).startswith("uvloop") == has_uvloop
    monkeypatch.setitem(sys.modules, "uvloop", None)
    assert run(loop_module()).startswith("asyncio")


class ClosesAfterEachAnswer(BaseHTTPRequestHandler):
    """Answers `GET /v1/models` with keep-alive framing, then closes the connection unannounced,
    as a server does to an idle kept-alive connection."""

    protocol_version = "HTTP/1.1"

    def do_GET(self):
        body = json.dumps({"object": "list", "data": [{"id": "m", "max_model_len": 8}]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        self.close_connection = True

    def log_message(self, *args):
        pass


@pytest.fixture
def closing_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), ClosesAfterEachAnswer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_kept_alive_connection_the_server_closed_is_replaced(closing_server):
    with Client(closing_server) as c:
        assert [[m.id for m in c.models()] for _ in range(3)] == [["m"]] * 3

    async def main():
        async with AsyncClient(closing_server) as ac:
            return [[m.id for m in await ac.models()] for _ in range(3)]

    assert run(main()) == [["m"]] * 3
