"""Shared pytest fixtures: tiny HF checkpoints (with real tokenizers) built once per session, and the
worker tests' executors on them (``executor_factory``, ``hf_model``: helpers/executors.py).

``tiny_llama`` is the default model for tests across the project; the others cover the
architecture table (Llama-3 rope scaling, Mistral sliding window, Qwen2 q/k/v bias, tied
embeddings). Each fixture is a ``pathlib.Path`` to an HF directory (see helpers/tiny_models.py).
"""

from __future__ import annotations

import os

# Triton kernels run on the CPU under the interpreter unless a GPU run asks otherwise
# (`make test-gpu` sets DELTASERVE_TEST_GPU=1). It must be set before anything imports triton.
if os.environ.get("DELTASERVE_TEST_GPU") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist every test process (and the daemons, workers and tools it starts) gets its
# share of the cores, not all of them: torch's OpenMP threads on oversubscribed cores wait at every
# barrier for a descheduled sibling, which made CPU decode steps 3-10x slower on 2-core CI.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    _share = max(1, len(os.sched_getaffinity(0)) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ.setdefault("DELTASERVE_WORKER_THREADS", str(_share))
    os.environ.setdefault("OMP_NUM_THREADS", str(_share))

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest

from helpers.executors import make_executor
from helpers.tiny_models import make_tiny_model
from helpers.triton_interpret import cache_np_dtypes, keep_language_patched, skip_discarded_overflow_checks

keep_language_patched()  # interpreted kernels: triton.language patched once, not at every launch
cache_np_dtypes()  # and their numpy dtypes looked up once per element type
skip_discarded_overflow_checks()  # and no int64 overflow check whose verdict device_assert discards

# The benchmarks are the `bench` package at the repository root (tests import `from bench import
# replay`); appended, so nothing installed is shadowed by a directory of the checkout.
if str(Path(__file__).resolve().parents[1]) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parents[1]))


@pytest.fixture(scope="session", autouse=True)
def _installed_package_when_testing_the_wheel() -> None:
    """`make test-wheel` sets DELTASERVE_EXPECT_WHEEL=1: the package (and its native module) must
    then come from the installed wheel, never from this checkout's source tree."""
    if os.environ.get("DELTASERVE_EXPECT_WHEEL") != "1":
        return
    import deltaserve
    import deltaserve._native as native

    sources = Path(__file__).resolve().parents[1] / "pyworker"
    for module in (deltaserve, native):
        where = Path(module.__file__ or "").resolve()
        assert where.is_relative_to(Path(sys.prefix).resolve()), f"{module.__name__} is {where}, not the wheel's"
        assert not where.is_relative_to(sources), f"{module.__name__} comes from the source tree ({where})"


@pytest.fixture(scope="session")
def tiny_models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny_models")


@pytest.fixture(scope="session")
def tiny_llama(tiny_models_dir: Path) -> Path:
    return make_tiny_model(tiny_models_dir, "llama")


@pytest.fixture(scope="session")
def tiny_llama3(tiny_models_dir: Path) -> Path:
    return make_tiny_model(tiny_models_dir, "llama3")


@pytest.fixture(scope="session")
def tiny_mistral(tiny_models_dir: Path) -> Path:
    return make_tiny_model(tiny_models_dir, "mistral")


@pytest.fixture(scope="session")
def tiny_qwen2(tiny_models_dir: Path) -> Path:
    return make_tiny_model(tiny_models_dir, "qwen2")


@pytest.fixture(scope="session")
def tiny_llama_tied(tiny_models_dir: Path) -> Path:
    return make_tiny_model(tiny_models_dir, "llama", tie_word_embeddings=True)


@pytest.fixture(scope="module")
def executor_factory(tiny_llama: Path):
    """``make(**kw)``: an Executor on the tiny Llama (``helpers.executors.make_executor``)."""

    def make(**kw):
        return make_executor(tiny_llama, **kw)

    return make


@pytest.fixture(scope="module")
def hf_model(tiny_llama: Path):
    """The tiny Llama in transformers, float32, eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
