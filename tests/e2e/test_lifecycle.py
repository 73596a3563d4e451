"""The worker's life as the router sees it: the handshake's schema check, and crash recovery."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx

from deltaserve import wire

from .daemon import Daemon

FAKE_HASH = "00000000deadbeef"


def test_schema_hash_mismatch_is_refused_naming_both(tiny_llama, tmp_path):
    # A "python" that runs the real worker with a different schema hash, as a stale install would.
    fake = tmp_path / "stale-python"
    fake.write_text(
        f"#!{sys.executable}\n"
        "import runpy, sys\n"
        "import deltaserve.wire as w\n"
        f"w.SCHEMA_HASH = {FAKE_HASH!r}\n"
        "assert sys.argv[1:3] == ['-m', 'deltaserve.worker'], sys.argv\n"
        "sys.argv = ['deltaserve.worker'] + sys.argv[3:]\n"
        "runpy.run_module('deltaserve.worker', run_name='__main__', alter_sys=True)\n"
    )
    fake.chmod(0o755)
    d = Daemon(tiny_llama, python=str(fake))
    try:
        code = d.wait_exit(120)
        logs = d.logs()
    finally:
        d.stop()
    assert code != 0
    assert FAKE_HASH in logs, logs[-3000:]
    assert wire.SCHEMA_HASH in logs, logs[-3000:]
    assert "schema" in logs.lower()


def _worker_pids(daemon_pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=,ppid=,args=", "-e"], capture_output=True, text=True).stdout
    pids = []
    for line in out.splitlines():
        pid, ppid, args = line.strip().split(None, 2)
        if int(ppid) == daemon_pid and "deltaserve.worker" in args:
            pids.append(int(pid))
    return pids


def test_worker_crash_fails_inflight_requests_and_restarts(tiny_llama):
    with Daemon(tiny_llama) as d:
        [pid] = _worker_pids(d.proc.pid)
        body = {"prompt": "crash test", "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}
        got_error = None
        with httpx.stream("POST", f"{d.url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    got_error = event["error"]
                    continue
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                    pid = None
        assert got_error is not None, "an in-flight request must end with an error event, not hang"
        assert "worker" in got_error["message"]

        deadline = time.monotonic() + 120
        while httpx.get(f"{d.url}/ready").status_code != 200:
            assert time.monotonic() < deadline, "worker was not restarted"
            time.sleep(0.2)
        r = httpx.post(
            f"{d.url}/v1/completions", json={"prompt": "after", "max_tokens": 3, "ignore_eos": True}, timeout=60
        )
        assert r.status_code == 200, r.text
        assert d.metrics()["deltaserve_worker_restarts_total"] >= 1


def test_two_workers_behind_one_router(tiny_llama, tiny_daemon):
    """`--devices cpu,cpu` runs two workers; requests spread over both and give the same tokens."""
    from .wsclient import ws_generate

    req = {"prompt": "two workers, one answer", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    want = ws_generate(tiny_daemon.url, {"x": req})["x"]["token_ids"]
    kv = tiny_daemon.metrics()["deltaserve_kv_blocks_total"]
    with Daemon(tiny_llama, "--devices", "cpu,cpu", "--kv-cache-bytes", str(_kv_bytes_of(tiny_daemon))) as d:
        assert len(_worker_pids(d.proc.pid)) == 2
        assert d.metrics()["deltaserve_kv_blocks_total"] == 2 * kv
        got = ws_generate(d.url, {f"r{i}": req for i in range(8)})
        for rid, r in got.items():
            assert r["token_ids"] == want, rid
        m = d.metrics()
        assert m["deltaserve_tokens_generated_total"] == 8 * 12
        assert m["deltaserve_placement_decisions_total"] == 8  # --placement caraserve, the default
        # Both workers served some: a worker that serves any request runs at least 12 steps for
        # it, and one worker batching all 8 would need only ~13, so 24 or more means two did.
        assert m["deltaserve_steps_total"] >= 2 * 12


def _kv_bytes_of(daemon) -> int:
    """The KV budget the tiny_daemon fixture was started with (from its command line)."""
    args = daemon.proc.args
    return int(args[args.index("--kv-cache-bytes") + 1])


def test_ctrl_c_in_a_terminal_stops_daemon_and_worker_quietly(tiny_llama):
    """A terminal's Ctrl-C signals the whole foreground process group: the router and its worker. The
    router drains and stops its worker; the worker leaves the shutdown to it, so the log shows no Python
    traceback, and no interpreter-teardown noise from native extensions (nanobind's leak report)."""
    d = Daemon(tiny_llama).wait_ready()
    try:
        r = httpx.post(f"{d.url}/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4}, timeout=120)
        assert r.status_code == 200, r.text
        os.killpg(d.proc.pid, signal.SIGINT)  # the daemon leads its own process group (Daemon: new session)
        assert d.wait_exit(60) == 0, d.logs()[-4000:]
        logs = d.logs()
        assert "shutting down" in logs
        assert "Traceback" not in logs and "KeyboardInterrupt" not in logs, logs[-4000:]
        assert "nanobind" not in logs, logs[-4000:]
    finally:
        d.stop()
