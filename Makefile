# rlgen — `make help` lists the targets.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev
ARGS ?=

.DEFAULT_GOAL := help
.PHONY: help install install-dev train test test-kernels test-all bench gpu-check lint clean

help:  ## list the targets
	@grep -hE '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "}; {printf "  \033[36m%-12s\033[0m %s\n", $$1, $$2}'

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml requirements/cpu.txt
	$(PIP) install -r requirements/cpu.txt
	$(PIP) install -e ".[ocr]"
	touch $@

$(DEV_STAMP): $(STAMP) requirements/reference.txt
	DS_BUILD_OPS=0 $(PIP) install -e ".[ocr,dev]"
	$(PIP) install --no-deps -r requirements/reference.txt
	touch $@

install: $(STAMP)  ## create .venv and install rlgen with the torch pinned in requirements/cpu.txt (README: Install)

install-dev: $(DEV_STAMP)  ## install plus the test and lint tools

train: install  ## run the default training (ShapesEval on the CPU, ~17 min); ARGS='algo.lr=1e-3' to override
	$(VENV)/bin/rlgen train $(ARGS)

# Two pytest-xdist workers, each file on one (tests/distributed on one worker as a whole: tests/conftest.py),
# each worker computing on one thread: the suite's many single-threaded stretches (imports, subprocess starts,
# loopback servers) overlap instead of queueing. PYTEST_WORKERS=0 runs it in one process.
PYTEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadfile)

test: install-dev  ## run the default test suite (CPU, offline, < 10 min); PYTEST_WORKERS=0 for one process
	$(PY) -m pytest -q $(XDIST) $(ARGS)

# The numerics-heavy tests once more on other CPU kernels: AVX2 code paths of oneDNN, MKL and ATen, one
# thread (other GEMM blocking and reduction splits), so a test tied to one machine's kernels fails here.
KERNEL_TESTS := tests/models tests/invariants tests/distributed tests/recipes tests/shapes
KERNEL_ENV := ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2 \
	OMP_NUM_THREADS=1 MKL_NUM_THREADS=1

test-kernels: install-dev  ## the models, invariants, distributed, recipes and shapes tests on AVX2 kernels, one thread
	$(KERNEL_ENV) $(PY) -m pytest -q $(XDIST) $(KERNEL_TESTS) $(ARGS)

test-all: install-dev  ## run every test, the slow ones included
	$(PY) -m pytest -q -m "not gpu" $(ARGS)

bench: install  ## run every benchmark script; each prints JSON (gpu_check.py: make gpu-check)
	@for f in benchmarks/*.py; do [ $$f = benchmarks/gpu_check.py ] && continue; echo "== $$f"; $(PY) $$f || exit 1; done

gpu-check: install  ## on a CUDA device: every row of docs/gpu.md in ≤ 8 min, one JSON; ARGS=--dry-run: tiny, on the CPU
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(PY) benchmarks/gpu_check.py $(ARGS)

lint: install-dev  ## ruff over the package, tests and benchmarks; import-linter's layer contracts; pyright (pyproject.toml)
	$(VENV)/bin/ruff check rlgen_cli tests benchmarks
	$(VENV)/bin/ruff format --check rlgen_cli tests benchmarks
	$(VENV)/bin/lint-imports --no-cache
	$(VENV)/bin/pyright --pythonpath $(PY)

clean:  ## remove runs, caches and the venv
	rm -rf $(VENV) outputs multirun .pytest_cache .ruff_cache
