"""The sync-free invocation op (``csrc/cpu_lora_signal.cu``) and its host fallback (``helpers/signal_op.py``).

On the CPU the fallback runs (here and in CI); the GPU tests (``gpu_kernels``) check on a device that
``send`` makes the rows visible in mapped host memory before the SEQ words without a host sync, that
``wait`` holds the stream until the DONE words are written by the host, and that its bound sets
``failed`` instead of hanging.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

from deltaserve.helpers import protocol as p
from deltaserve.helpers import signal_op


def test_fallback_send_and_wait_on_the_cpu() -> None:
    x = torch.randn(5, 8)
    dst = torch.zeros(5, 8)
    words = torch.zeros(3, p.JOB_WORDS, dtype=torch.int64)
    signal_op.send(x, dst, words, p.SEQ, 7)
    assert torch.equal(dst, x) and words[:, p.SEQ].tolist() == [7, 7, 7]
    failed = torch.zeros(1, dtype=torch.int32)
    threading.Timer(0.05, lambda: words[:, p.DONE].fill_(7)).start()
    signal_op.wait(words, p.DONE, 7, failed, timeout_s=10.0, device=torch.device("cpu"))
    assert failed.item() == 0 and words[:, p.DONE].tolist() == [7, 7, 7]
    signal_op.wait(words, p.DONE, 8, failed, timeout_s=0.01, device=torch.device("cpu"))
    assert failed.item() == 1


needs_op = pytest.mark.skipif(
    not torch.cuda.is_available() or signal_op.library() is None, reason="needs a CUDA device and the built op"
)


@pytest.mark.gpu_kernels
@needs_op
def test_send_queues_copy_then_flag_and_wait_holds_the_stream() -> None:
    dev = torch.device("cuda")
    x = torch.randn(64, 256, device=dev)
    dst = torch.zeros(64, 256)
    # The control words in a shared file mapping, as the helper processes share them (helpers/shm.py).
    words_file = Path(tempfile.mkdtemp(dir="/dev/shm")) / "words"  # tmpfs, as the helpers' segments
    words_file.write_bytes(bytes(4096))  # a whole page: what cudaHostRegister pins
    words = torch.from_file(str(words_file), shared=True, size=2 * p.JOB_WORDS, dtype=torch.int64).view(2, -1)
    failed_host = torch.zeros(1, dtype=torch.int32)
    for t in (dst, words, failed_host):
        signal_op.register_mapped(t)
    torch.cuda.synchronize()
    torch.cuda._sleep(50_000_000)  # the stream is busy: send must return before its copy runs
    signal_op.send(x, dst, words, p.SEQ, 3)
    deadline = time.monotonic() + 10
    while int(words[0, p.SEQ]) != 3:  # no host sync: the device writes the word when it gets there
        assert time.monotonic() < deadline
    assert torch.equal(dst, x.cpu())

    failed = torch.zeros(1, dtype=torch.int32, device=dev)
    after = torch.ones(1, device=dev)
    begin, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    # A stand-in helper process writes the DONE words 0.3 s from now: another process, as in serving, so
    # no call of this thread that blocks while the wait spins (a new allocator segment's cudaMalloc, an
    # event's creation) can hold it back.
    offsets = [(row * p.JOB_WORDS + p.DONE) * 8 for row in range(2)]
    script = (
        f"import mmap, struct, time; time.sleep(0.3); f = open({str(words_file)!r}, 'r+b')\n"
        f"m = mmap.mmap(f.fileno(), 0)\nfor o in {offsets!r}: m[o:o + 8] = struct.pack('<q', 3)\n"
    )
    helper = subprocess.Popen([sys.executable, "-c", script])
    torch.cuda.synchronize()
    begin.record()
    signal_op.wait(words, p.DONE, 3, failed, timeout_s=10.0, device=dev)
    after.add_(1)  # queued behind the wait
    done.record()
    done.synchronize()
    assert helper.wait(timeout=30) == 0
    assert failed.item() == 0, "the wait saw the DONE words (no timeout)"
    assert after.item() == 2
    assert begin.elapsed_time(done) >= 150, "the stream waits for the helpers' DONE words"
    shutil.rmtree(words_file.parent)
    signal_op.wait(words, p.DONE, 4, failed, timeout_s=0.01, device=dev)
    torch.cuda.synchronize()
    assert failed.item() == 1, "a bounded wait reports failure instead of hanging"
