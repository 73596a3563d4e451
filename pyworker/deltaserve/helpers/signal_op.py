"""Sync-free invocation of the helpers on CUDA (``csrc/cpu_lora_signal.cu``), with a fallback.

``send`` queues, on the current stream, the copy of ``x``'s rows into pinned, mapped host memory and
then the helpers' ``SEQ`` words: the launching thread does not wait, and stream order makes the rows
visible before the words. ``wait`` queues a device-side wait for the helpers' ``DONE`` words (bounded:
past ``max_cycles`` it sets ``failed`` and returns, so the stream never hangs; the worker reads
``failed`` when it finishes the step). Work queued after ``wait`` sees the helpers' results. While the
wait spins, a host call that synchronises with the device (``cudaMalloc`` of a new allocator segment,
``.item()``) blocks the launching thread until the helpers answer or the bound passes: the DONE words
must come from the helper processes, never from the launching thread after such a call.

Host memory must be registered as mapped (``register_mapped``); the op translates the words' host
addresses to device ones (``cudaHostGetDevicePointer``). Without the built op (no CUDA device,
no nvcc, ``--cuda-ops false``) both run host-synchronised: a blocking copy and word writes, and a
host poll of the words with a deadline. ``signalled.py`` drives it for ``assist.py``'s sync-free
invocation.
"""

from __future__ import annotations

import ctypes
import time

import torch

from ..kernels import cuda_ext

OP = "cpu_lora_signal"
CUDA_HOST_REGISTER_MAPPED = 2
DEVICE_CYCLES_PER_S = 2e9
"""Clock cycles per second ``wait`` converts its bound with (an H100's or H200's boost clock is about 2 GHz;
the bound is a guard against a hang, not a timer)."""


def library() -> ctypes.CDLL | None:
    """The built op on CUDA machines, else None (the fallback runs)."""
    return cuda_ext.library(OP) if torch.cuda.is_available() else None


def register_mapped(t: torch.Tensor) -> None:
    """Page-locks ``t``'s memory (a contiguous CPU tensor) as mapped for the device."""
    err = int(
        torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), CUDA_HOST_REGISTER_MAPPED)
    )
    if err != 0:
        raise RuntimeError(f"cudaHostRegister(mapped) of {t.numel() * t.element_size()} bytes failed (cudaError {err})")


def send(x: torch.Tensor, dst: torch.Tensor, words: torch.Tensor, word: int, seq: int) -> None:
    """Copies ``x`` into ``dst`` (host, same bytes), then sets ``words[:, word] = seq``
    (``words``: [helpers, JOB_WORDS] int64 host). Queued on the current stream on CUDA."""
    lib = library() if x.is_cuda else None
    if lib is None:
        dst.copy_(x)  # host-synchronised: the copy is done when this returns
        words[:, word] = seq
        return
    nbytes = x.numel() * x.element_size()
    code = lib.deltaserve_cpu_lora_send(
        ctypes.c_void_p(dst.data_ptr()), ctypes.c_void_p(x.data_ptr()), ctypes.c_size_t(nbytes),
        ctypes.c_void_p(words[:, word].data_ptr()), ctypes.c_int(words.shape[0]), ctypes.c_int(words.stride(0)),
        ctypes.c_int64(seq), ctypes.c_void_p(torch.cuda.current_stream(x.device).cuda_stream),
    )  # fmt: skip
    cuda_ext.check(lib, code, "deltaserve_cpu_lora_send")


def wait(
    words: torch.Tensor, word: int, seq: int, failed: torch.Tensor, *, timeout_s: float, device: torch.device
) -> None:
    """Until ``words[:, word] == seq`` for every helper, or the bound (then ``failed[0] = 1``).
    On CUDA a kernel queued on the current stream waits (``timeout_s`` becomes clock cycles,
    ``DEVICE_CYCLES_PER_S``); else the host polls."""
    lib = library() if device.type == "cuda" else None
    if lib is None:
        deadline = time.monotonic() + timeout_s
        while not bool((words[:, word] == seq).all()):
            if time.monotonic() > deadline:
                failed.fill_(1)
                return
            time.sleep(0)
        return
    cycles = int(timeout_s * DEVICE_CYCLES_PER_S)
    code = lib.deltaserve_cpu_lora_wait(
        ctypes.c_void_p(words[:, word].data_ptr()), ctypes.c_int(words.shape[0]), ctypes.c_int(words.stride(0)),
        ctypes.c_int64(seq), ctypes.c_longlong(cycles), ctypes.c_void_p(failed.data_ptr()),
        ctypes.c_void_p(torch.cuda.current_stream(device).cuda_stream),
    )  # fmt: skip
    cuda_ext.check(lib, code, "deltaserve_cpu_lora_wait")


__all__ = ["OP", "library", "register_mapped", "send", "wait"]
