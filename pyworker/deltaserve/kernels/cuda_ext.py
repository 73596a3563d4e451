"""Builds and loads the CUDA C++ ops of ``csrc/`` (one shared library per source file) on GPU machines.

Each ``csrc/<name>.cu`` exports plain C functions (raw device pointers and a stream handle, so a
call can be captured in a CUDA graph); ``library(name)`` compiles it once with ``nvcc`` for the
current GPU's architecture and returns a ``ctypes.CDLL``, or None where that cannot happen (no CUDA
device, no nvcc, a failed build: the reason is logged once and ``unavailable(name)`` returns it).
Callers then keep their Triton kernel, so these ops are optional everywhere::

    csrc/sbmm.cu --nvcc -O3 -arch=sm_XY--> $DELTASERVE_CACHE/cuda/sbmm-<source hash>-sm_XY.so
                                            (written to a temporary name, then renamed: concurrent
                                             workers never load half a file)

Settings: a worker takes them from its ``WorkerConfig`` (``cuda_ops``, ``cache_dir``: the router's
``--cuda-ops`` and ``--cache-dir``) through ``configure``. Elsewhere (tests, benchmarks) the
same flags' environment aliases apply: ``DELTASERVE_CUDA_OPS=0`` turns the ops off (the Triton
kernels run instead); ``DELTASERVE_CACHE`` moves the cache (default ``~/.cache/deltaserve``).
``CUDA_HOME`` names the toolkit when ``nvcc`` is not on PATH. ``python -m deltaserve.kernels.cuda_ext`` builds every op
ahead of time (a worker would otherwise pay the build at its first delta step).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCES = Path(__file__).resolve().parent.parent / "csrc"
"""Where the ``.cu`` files are (``csrc/`` at the repository root links here)."""

NVCC_FLAGS = ("-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "-lineinfo", "--split-compile=0")
"""``--split-compile=0``: the kernels' instantiations are optimised on every core (csrc/sbmm.cu has ~150)."""

DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1}
"""The ``dtype`` argument of the ops' C entry points (csrc/sbmm.cu: 0 float16, 1 bfloat16)."""

_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}
_why_not: dict[str, str] = {}
_settings: dict[str, bool | str | None] = {}
"""The worker's settings from ``configure`` (``enabled``, ``cache_dir``); the environment otherwise."""


def configure(enabled: bool, cache_dir: str | None) -> None:
    """Sets whether the ops may be used and where they are built (a worker's ``WorkerConfig``),
    instead of the environment variables; before the first ``library`` call."""
    _settings["enabled"] = enabled
    _settings["cache_dir"] = cache_dir


def _turned_on() -> bool:
    if "enabled" in _settings:
        return bool(_settings["enabled"])
    return os.environ.get("DELTASERVE_CUDA_OPS", "1") != "0"


def enabled() -> bool:
    """Whether the CUDA ops may be used at all (a CUDA device, and not turned off)."""
    return _turned_on() and torch.cuda.is_available()


def nvcc() -> str | None:
    """The nvcc to build with: on PATH, else under ``CUDA_HOME`` or /usr/local/cuda."""
    found = shutil.which("nvcc")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and (Path(root) / "bin" / "nvcc").is_file():
            return str(Path(root) / "bin" / "nvcc")
    return None


def cache_dir() -> Path:
    configured = _settings.get("cache_dir")
    root = str(configured or os.environ.get("DELTASERVE_CACHE") or Path.home() / ".cache" / "deltaserve")
    return Path(root) / "cuda"


def _arch() -> str:
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


def build(name: str) -> Path:
    """Compiles ``csrc/<name>.cu`` (or finds it already built); returns the library path. Raises on failure."""
    src = SOURCES / f"{name}.cu"
    if not src.is_file():
        raise FileNotFoundError(f"cuda op {name}: no source {src}")
    compiler = nvcc()
    if compiler is None:
        raise FileNotFoundError("cuda op: nvcc not found (PATH, CUDA_HOME, /usr/local/cuda)")
    arch = _arch()
    # The source and every header beside it (``*.cuh``: the ops include theirs), so a header's change rebuilds.
    headers = b"".join(h.read_bytes() for h in sorted(SOURCES.glob("*.cuh")))
    digest = hashlib.sha256(src.read_bytes() + headers + " ".join(NVCC_FLAGS).encode()).hexdigest()[:16]
    target = cache_dir() / f"{name}-{digest}-{arch}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}-", suffix=".so", dir=target.parent)
    os.close(fd)
    cmd = [compiler, *NVCC_FLAGS, f"-arch={arch}", "-o", tmp, str(src)]
    log.info("cuda op %s: building for %s (%s)", name, arch, " ".join(cmd))
    try:
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"cuda op {name}: nvcc failed ({done.returncode}):\n{done.stderr[-4000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def library(name: str) -> ctypes.CDLL | None:
    """The loaded op library, built on first use; None (reason logged once) when it cannot be had."""
    with _lock:
        if name in _loaded:
            return _loaded[name]
        lib = None
        if not enabled():
            off = "turned off (--cuda-ops false, DELTASERVE_CUDA_OPS=0)"
            _why_not[name] = "no CUDA device" if not torch.cuda.is_available() else off
        else:
            try:
                lib = ctypes.CDLL(str(build(name)))
            except Exception as e:  # noqa: BLE001 - any build or load failure leaves the Triton path
                _why_not[name] = str(e)
                log.warning("cuda op %s unavailable, using the Triton kernel: %s", name, e)
        _loaded[name] = lib
        return lib


def unavailable(name: str) -> str | None:
    """Why ``library(name)`` returned None (None if it was loaded or never asked for)."""
    return _why_not.get(name)


def check(lib: ctypes.CDLL, code: int, what: str) -> None:
    """Raises ``RuntimeError`` with CUDA's message when an op's C entry point returned an error."""
    if code != 0:
        lib.deltaserve_cuda_error_string.restype = ctypes.c_char_p
        raise RuntimeError(f"{what}: CUDA error {code}: {lib.deltaserve_cuda_error_string(code).decode()}")


def main() -> int:
    """Builds every op in ``csrc/`` now; prints where each went or why it failed."""
    logging.basicConfig(level=logging.INFO)
    failed = 0
    for src in sorted(SOURCES.glob("*.cu")):
        try:
            print(f"{src.stem}: {build(src.stem)}")
        except Exception as e:  # noqa: BLE001 - report every op
            failed += 1
            print(f"{src.stem}: FAILED: {e}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
