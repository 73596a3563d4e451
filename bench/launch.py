"""Starting the servers the benchmarks measure, and where they listen: the one place that runs a
server process, waits for it to be ready and stops it.

    ServerSpec             what a server launcher gets (model, variants, devices, flags, log)
    Endpoint               where a started server listens (and which model every request names)
    launch(cmd, url, log)  runs a server in its own session, yields once GET /ready is 200, then
                           stops it (SIGTERM, SIGKILL after 60 s)
    deltaserve_server      the daemon on a free port (bench/serving's ``--server deltaserve``)
    module_command         ``python -m bench.X ...`` for a benchmark program run as a child
                           (the baselines, the fake server), with ``bench_env`` its environment

Imported by bench/serving (the experiments' launchers), bench/eval_quality.py and
bench/replay_capacity.py; it imports no other benchmark module but ``common``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import REPO


@dataclass
class ServerSpec:
    """What a server launcher gets."""

    model_dir: Path | None
    """HF model directory; None serves the daemon's bundled demo model."""
    lora_dir: Path | None
    """Every adapter the experiment's traces use (``--lora-dir``; None: no adapters), or the swap
    baseline's directory of full models."""
    devices: str
    """``cpu`` or CUDA ids."""
    flags: list[str] = field(default_factory=list)
    """Extra server flags (the experiment's, then ``--server-flag``s)."""
    daemon: Path | None = None
    """The deltaserve binary."""
    log: Path | None = None
    """Where the server's output goes."""
    deltas: dict[str, Path] = field(default_factory=dict)
    """Compressed deltas the daemon serves (``--delta NAME=DIR``), by name."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment the daemon (and so its workers) gets on top of this process's."""
    python: str | None = None
    """The daemon's ``--python`` (None: this interpreter); a ``deltaserve.sim.record.recording_python``
    script records every step its worker runs (``bench.serving --record``, bench/sim_validate.py)."""


@dataclass(frozen=True)
class Endpoint:
    """Where a started server listens."""

    url: str
    """Base URL of /v1/completions."""
    ws_url: str | None = None
    """The /v1/ws URL when it is not ``url``'s (the fake serves it on a second port)."""
    model: str | None = None
    """The ``model`` every request names, whatever its variant (the merged baseline serves one
    model); None sends each request's variant name."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def demo_model_dir(python: str = sys.executable) -> Path:
    """The bundled demo model's HF directory (converted on first use by ``deltaserve.demo_model``)."""
    out = subprocess.run([python, "-m", "deltaserve.demo_model", "--print-path"], check=True, capture_output=True,
                         text=True)  # fmt: skip
    return Path(out.stdout.strip().splitlines()[0])


def default_daemon() -> Path:
    """The deltaserve binary: $DELTASERVE_BIN, else the release build, else the debug build."""
    env = os.environ.get("DELTASERVE_BIN")
    builds = [REPO / "target" / "release" / "deltaserve", REPO / "target" / "debug" / "deltaserve"]
    for p in ([Path(env)] if env else []) + builds:
        if p.is_file():
            return p
    raise FileNotFoundError(
        "no deltaserve binary: set DELTASERVE_BIN or --daemon, or `cargo build --release -p deltaserve-daemon`"
    )


def module_command(module: str, *args: str) -> list[str]:
    """``python -m module args`` with this interpreter: how a benchmark program (``bench.baselines``,
    ``bench.fake_server``) runs as a child process; give it :func:`bench_env`."""
    return [sys.executable, "-m", module, *args]


def bench_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment with the repository root first on PYTHONPATH (so the ``bench``
    package imports in a child, whatever its working directory), plus ``extra``."""
    path = [str(REPO), *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), **(extra or {})}


def wait_ready(url: str, proc: subprocess.Popen | None, timeout_s: float, log: Path | None) -> None:
    """Returns once GET ``url``/ready answers 200; raises when ``proc`` exits first (with the tail
    of ``log``) or after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text(errors="replace")[-4000:] if log else ""
            raise RuntimeError(f"the server exited with {proc.returncode} before /ready:\n{tail}")
        try:
            with urllib.request.urlopen(f"{url}/ready", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url}/ready not 200 after {timeout_s} s (log: {log})")


@contextlib.contextmanager
def launch(cmd: list[str], url: str, log_path: Path | None, ready_timeout_s: float = 1800,
           env: Mapping[str, str] | None = None) -> Iterator[str]:  # fmt: skip
    """Runs ``cmd`` (a server listening at ``url``) in its own session, output to ``log_path``;
    yields ``url`` once /ready answers 200, and stops the server (SIGTERM, then SIGKILL) after.
    ``env``: the child's environment (default this process's); RUST_LOG defaults to ``info``."""
    log = open(log_path, "w") if log_path else subprocess.DEVNULL
    base = os.environ if env is None else env
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**base, "RUST_LOG": base.get("RUST_LOG", "info")})  # fmt: skip
    try:
        wait_ready(url, proc, ready_timeout_s, log_path)
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if log is not subprocess.DEVNULL:
            log.close()


@contextlib.contextmanager
def deltaserve_server(spec: ServerSpec) -> Iterator[Endpoint]:
    """The deltaserve daemon on a free port, with every adapter from ``spec.lora_dir`` and every
    delta of ``spec.deltas``."""
    daemon = spec.daemon or default_daemon()
    port = free_port()
    python = spec.python or sys.executable
    cmd = [str(daemon), "--port", str(port), "--python", python, "--devices", spec.devices, *spec.flags]
    if spec.lora_dir is not None:
        cmd += ["--lora-dir", str(spec.lora_dir)]
    for name, d in spec.deltas.items():
        cmd += ["--delta", f"{name}={d}"]
    if spec.model_dir is not None:
        cmd += ["--model", str(spec.model_dir)]
    with launch(cmd, f"http://127.0.0.1:{port}", spec.log, env={**os.environ, **spec.env}) as url:
        yield Endpoint(url)
