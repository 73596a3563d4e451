"""The sync-free invocation op (``csrc/cpu_lora_signal.cu``) and its host fallback (``helpers/signal_op.py``).

On the CPU the fallback runs (here and in CI); the GPU tests (``gpu_kernels``) check on a device that
``send`` makes the rows visible in mapped host memory before the SEQ words without a host sync, that
``wait`` holds the stream until the DONE words are written by the host, and that its bound sets
``failed`` instead of hanging.
"""

from __future__ import annotations

import threading
import time

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
    words = torch.zeros(2, p.JOB_WORDS, dtype=torch.int64)
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
    signal_op.wait(words, p.DONE, 3, failed, timeout_s=10.0, device=dev)
    after = torch.ones(1, device=dev)
    after.add_(1)  # queued behind the wait
    done = torch.cuda.Event()
    done.record()
    time.sleep(0.05)
    assert not done.query(), "the stream waits for the helpers' DONE words"
    words[:, p.DONE] = 3
    done.synchronize()
    assert failed.item() == 0 and after.item() == 2
    signal_op.wait(words, p.DONE, 4, failed, timeout_s=0.01, device=dev)
    torch.cuda.synchronize()
    assert failed.item() == 1, "a bounded wait reports failure instead of hanging"
