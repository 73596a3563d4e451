"""``host_to_device`` / ``copy_from_host`` (``model/batch.py``): small tensors reach the device through
one pinned staging buffer allocated once; its halves are refilled only after the copies queued from
them have run. CPU: ``host_to_device`` hands back the host tensor itself. CUDA (run by
``make test-gpu``): every copy arrives intact while the device is kept busy, so copies are still
queued when the staging wraps around."""

from __future__ import annotations

import pytest
import torch

from deltaserve.model import batch

pytestmark = pytest.mark.gpu_kernels  # `make test-gpu-kernels` selects it on a GPU


def test_cpu_is_the_host_tensor_itself() -> None:
    x = torch.arange(5)
    assert batch.host_to_device(x, "cpu") is x
    dst = torch.zeros(5, dtype=torch.long)
    batch.copy_from_host(dst, x)
    assert dst.tolist() == [0, 1, 2, 3, 4]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (make test-gpu)")
def test_staged_copies_arrive_intact_across_many_wraps(monkeypatch: pytest.MonkeyPatch) -> None:
    # A 64 KB staging buffer (two 32 KB halves) wraps every few calls.
    monkeypatch.setattr(batch, "STAGING_BYTES", 64 << 10)
    monkeypatch.setattr(batch, "STAGED_MAX", 8 << 10)
    monkeypatch.setattr(batch, "_staging", None)
    gen = torch.Generator().manual_seed(0)
    dev = torch.device("cuda")
    sent, got = [], []
    table = torch.zeros(64, 16, dtype=torch.int32, device=dev)
    for i in range(400):
        if i % 50 == 0:
            torch.cuda._sleep(20_000_000)  # keep the stream busy: the copies below stay queued
        n = int(torch.randint(0, 2000, (1,), generator=gen))
        dtype = (torch.int64, torch.int32, torch.float32, torch.bool)[i % 4]
        host = torch.randint(0, 1000, (n,), generator=gen).to(dtype)
        sent.append(host.clone())
        got.append(batch.host_to_device(host, dev))
        host.fill_(0)  # the caller may reuse its tensor at once
        if i % 7 == 0:
            rows = torch.randint(0, 1 << 20, (64, 16), generator=gen, dtype=torch.int32)
            batch.copy_from_host(table, rows[:, ::1])
            got.append(table.clone())
            sent.append(rows)
    assert batch._staging is not None and batch._staging.buf.numel() == 64 << 10
    big = torch.randn(16 << 10)  # 64 KB, larger than STAGED_MAX: pinned on its own
    assert torch.equal(batch.host_to_device(big, dev).cpu(), big)
    torch.cuda.synchronize()
    for i, (want, have) in enumerate(zip(sent, got)):
        assert torch.equal(have.cpu(), want), f"copy {i} changed on its way"
