"""The shared-memory link as the Python worker uses it (``deltaserve._native``): a ``RouterLink``
in this process and a ``WorkerLink`` in a child process exchange thousands of frames in order,
and the error paths say what is wrong.
"""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from deltaserve import _native, wire

# The worker side: announce itself with a Hello frame, read how many frames will follow, then echo
# each back reversed (empty frames included) and exit.
ECHO_WORKER = textwrap.dedent(
    """
    import os, sys
    from deltaserve import _native, wire

    link = _native.WorkerLink(sys.argv[1])
    link.send(wire.encode(wire.Hello(schema_hash=wire.SCHEMA_HASH, pid=os.getpid())))
    count = int(link.recv(timeout_s=60) or b"-1")
    for i in range(count):
        frame = link.recv(timeout_s=60)
        if frame is None:
            sys.exit(f"router went silent before frame {i}")
        link.send(frame[::-1])
    """
)


def frame_for(i: int, rng: random.Random, max_len: int) -> bytes:
    size = rng.choice([0, 1, max_len]) if i % 10 == 0 else rng.randrange(1, 5000)
    return rng.randbytes(size)


def test_frames_cross_processes_in_order(tmp_path: Path) -> None:
    # A 64 KiB ring: thousands of frames up to 32 KiB wrap it many times and fill it often.
    router = _native.RouterLink(str(tmp_path / "link"), capacity=1 << 16)
    worker = subprocess.Popen([sys.executable, "-c", ECHO_WORKER, router.ipc_dir])
    try:
        hello = wire.decode(router.recv(timeout_s=60) or b"")
        assert isinstance(hello, wire.Hello)
        assert hello.pid == worker.pid and hello.schema_hash == _native.schema_hash()

        n = 3000
        frames = [frame_for(i, random.Random(i), router.max_frame_len) for i in range(n)]
        # Send from a second thread while this one receives: send and recv release the GIL and
        # have separate locks, so neither side can wedge the other with a full ring.
        router.send(str(n).encode())
        sender = threading.Thread(target=lambda: [router.send(f, timeout_s=60) for f in frames])
        sender.start()
        for i, sent in enumerate(frames):
            back = router.recv(timeout_s=60)
            assert back is not None, f"no echo for frame {i}"
            assert back == sent[::-1], f"frame {i} came back wrong"
        sender.join(timeout=60)
        assert worker.wait(timeout=60) == 0
        assert router.recv(timeout_s=0) is None
    finally:
        if worker.poll() is None:
            worker.kill()


def test_recv_times_out_with_none(tmp_path: Path) -> None:
    router = _native.RouterLink(str(tmp_path))
    worker = _native.WorkerLink(str(tmp_path))
    t = time.monotonic()
    assert worker.recv(timeout_s=0.05) is None
    assert time.monotonic() - t >= 0.05
    assert router.recv(timeout_s=0) is None
    router.send(b"plan")
    assert worker.recv(timeout_s=0) == b"plan"


def test_oversize_frame_is_refused_clearly(tmp_path: Path) -> None:
    router = _native.RouterLink(str(tmp_path), capacity=4096)
    assert router.max_frame_len == 2044
    router.send(b"x" * router.max_frame_len)
    with pytest.raises(ValueError, match="large bytes never travel on the ring"):
        router.send(b"x" * (router.max_frame_len + 1))


def test_full_ring_send_times_out(tmp_path: Path) -> None:
    router = _native.RouterLink(str(tmp_path), capacity=4096)
    with pytest.raises(TimeoutError, match="stayed full"):
        for _ in range(100):  # nobody reads: 4096 bytes fill after a few 1000-byte frames
            router.send(b"y" * 1000, timeout_s=0.01)


def test_bad_arguments_and_missing_files(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="to_worker.ring"):
        _native.WorkerLink(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="power of two"):
        _native.RouterLink(str(tmp_path / "bad"), capacity=1000)
    router = _native.RouterLink(str(tmp_path / "ok"))
    with pytest.raises(ValueError, match="timeout_s"):
        router.recv(timeout_s=-1.0)
    assert _native.DEFAULT_CAPACITY == 4 << 20
    assert "RouterLink" in repr(router)
